"""Hostile chat templates (issue 33 item 3d): each fails as one ValueError naming the template and its
line, within the render's time and output bounds, never a traceback, a hang or gigabytes."""

from __future__ import annotations

import resource

import pytest

from kvcache_exporter.analyzer.chat_template import MAX_OUTPUT_CHARS, RENDER_SECONDS, ChatTemplate

MESSAGES = [{"role": "user", "content": "hi"}]
CASES = {
    "division by zero": ("{{ 1/0 }}", "ZeroDivisionError"),
    "nested range loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}"
        "{% endfor %}{% endfor %}{% endfor %}",
        f"rendering took more than {RENDER_SECONDS:g} s",
    ),
    "loops that call nothing": (
        "{% set r = range(100000)|list %}\n{% for a in r %}{% for b in r %}{% endfor %}{% endfor %}",
        f"rendering took more than {RENDER_SECONDS:g} s",
    ),
    "string repetition": ("{{ 'x' * 3000000000 }}", f"over {MAX_OUTPUT_CHARS:,}"),
    "output loop": (
        "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}",
        f"over {MAX_OUTPUT_CHARS:,}",
    ),
    "join then repeat": ("{{ (range(100000)|join(',')) * 10000 }}", f"over {MAX_OUTPUT_CHARS:,}"),
    "doubling with ~": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        f"over {MAX_OUTPUT_CHARS:,}",
    ),
    "a filter's width": ("{{ 'x'|center(3000000000) }}", f"over {MAX_OUTPUT_CHARS:,}"),
    "a huge exponent": ("{{ 2 ** 100000000 }}", "an exponent of 100000000"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_hostile_template_is_one_error_naming_template_and_line(case):
    source, reason = CASES[case]
    template = ChatTemplate("\n\n" + source, "tok/chat_template.jinja", {})
    with pytest.raises(ValueError) as caught:
        template.render(messages=MESSAGES)
    message = str(caught.value)
    assert message.startswith("the chat template fails on these messages (tok/chat_template.jinja")
    if case != "output loop":  # (the output's total is checked outside the template's code: no line)
        assert "(tok/chat_template.jinja, line 3" in message or "line 4" in message
    assert reason in message
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 1 << 20  # KiB: under 1 GiB, never 3 GiB


def test_a_real_template_renders_as_before_and_a_broken_one_names_its_line():
    template = ChatTemplate(
        "{% for m in messages %}\n[{{ m['role'] | upper }}]{{ m['content'] ~ '!' }}{% endfor %}", "t", {}
    )
    assert template.render(messages=MESSAGES * 2) == "[USER]hi![USER]hi!"
    with pytest.raises(ValueError, match=r"does not compile \(t, line 2\)"):
        ChatTemplate("ok\n{% for %}", "t", {})
