"""Chat workloads with one known injected change per request, at the token-id level. Pure, seeded.

A *case* is a few requests sent one after another: setup requests (not scored) that put the cache in a
known state, then one scored request carrying exactly one injected change (or none: an exact repeat),
then up to two append-only next turns of the same chat (scored: they must never get a fault cause).
Cases are independent (fresh random content) and sent in sequence, so a case's setup is always the
last thing before its change: the truth holds by construction, not by luck of the cache.

The history kinds are chats as they really go: the engine generates the assistant's answer (decode,
`Request.answer` tokens), and the next request re-renders it (`Request.follows`: the previous prompt,
its answer as the template writes it back, then this request's `prompt`). The backend says what it
generated; the harness fills the prompt in (`Request.sent`) before sending it.

Prompts are rendered by a toy chat template (role headers of five fixed tokens, an end token, openers
that recur across chats), so repeated template text is there to be mistaken for moved content.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

TOKEN_LOW, TOKEN_HIGH = 20, 500  # content ids; 1-19 are the template's
SYSTEM, USER, ASSISTANT = (1, 9, 11, 12, 2), (1, 9, 13, 12, 2), (1, 9, 14, 12, 2)
END, TOOL_CALL, DOCUMENT, TOOL = (3,), (4, 15), (4, 16), (4, 17)
OPENERS = ((301, 44, 87, 250, 19), (122, 480, 61, 19), (77, 310, 205, 33, 19))  # "Sure, here is ..."

# kind -> (the cause a right attribution names, what was injected). "hit": no miss tokens at all.
KINDS = {
    "timestamp_first": ("prefix_diverged", "a timestamp field first, new each request (4-10 tokens)"),
    "request_id_first": ("prefix_diverged", "a request id first, new each request (6-14 tokens)"),
    "uuid_first": ("prefix_diverged", "a uuid first, new each request (20-36 tokens)"),
    "field_after_system": ("prefix_diverged", "a per-request field after the system prompt"),
    "append_turn": ("cold", "none: the next turn appended to the chat"),
    "exact_repeat": ("hit", "none: the same prompt again"),
    "cache_reset": ("restart", "the prefix cache reset (vLLM /reset_prefix_cache), then the prompt again"),
    "engine_restart": ("restart", "the engine restarted (a new publisher), then the prompt again"),
    "capacity_overflow": ("evicted", "more prompts than the cache holds, then each again"),
    "assistant_truncated": (
        "history_rewritten",
        "the answer the model generated, re-rendered in the next turn without its first tokens (reasoning)",
    ),
    "tool_args_reserialized": (
        "history_rewritten",
        "the tool call the model generated, re-rendered in the next turn with its arguments reordered",
    ),
    "documents_reranked": ("content_moved", "the same documents in another order"),
    "tools_reordered": ("content_moved", "the same tool definitions in another order"),
    "other_identity": ("identity_isolated", "the same prompt under another LoRA adapter or cache_salt"),
    "short_shared_prefix": ("below_hit_unit", "shared content shorter than the hit unit"),
    "window_dropped": ("window_expired", "a sliding-window part dropped while the full part is held"),
    "host_tier_load": ("tier_restored", "the prompt loaded back from the host tier"),
}
FAULTS = frozenset(cause for cause, _ in KINDS.values()) - {"cold", "hit"}


@dataclass(frozen=True)
class Shape:
    """What a backend serves: its hit unit, how many tokens its GPU cache and a prompt hold, the kinds it
    can inject (a kind needing an action it lacks, a host tier or window eviction, is left out)."""

    name: str
    unit: int
    capacity_tokens: int
    max_prompt: int
    kinds: tuple[str, ...]
    # window_dropped's fill: measured on the server (a "drop_window" action, sent until its events show
    # the prompt's window part removed, its full part held) instead of half a cache of prompts
    fill_by_events: bool = False


@dataclass(frozen=True)
class Rerender:
    """How the chat template writes a generated answer back into the next prompt: without its first
    `drop` tokens (a reasoning preamble, DeepSeek-R1-style); cut at `cuts` and the pieces written in
    reverse order (a tool call's arguments re-serialised with their keys in another order); else
    verbatim."""

    drop: int = 0
    cuts: tuple[int, ...] = ()

    def __call__(self, answer: tuple[int, ...]) -> tuple[int, ...]:
        kept = answer[self.drop :]
        if not self.cuts:
            return kept
        bounds = (0, *self.cuts, len(kept))
        return sum((kept[a:b] for a, b in reversed(list(itertools.pairwise(bounds)))), ())


VERBATIM = Rerender()


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]  # with `follows`: what comes after the re-rendered answer
    kind: str  # the case's injected kind
    expected: str | None  # the truth; None: a setup request, not scored
    before: str | None = None  # "reset", "restart" or "drop_window": what the backend does (below)
    identity: str | None = None  # a LoRA adapter or cache_salt
    answer: int = 0  # tokens the engine generates (max_tokens; 0: one, never used)
    follows: Rerender | None = None  # the prompt: the previous one, its answer so re-rendered, `prompt`

    def sent(self, previous: tuple[int, ...], answer: tuple[int, ...]) -> Request:
        """The request as sent after `previous` (the case's last prompt as sent) generated `answer`."""
        if self.follows is None:
            return self
        return replace(self, prompt=(*previous, *self.follows(answer), *self.prompt), follows=None)


@dataclass(frozen=True)
class Chat:
    """A prompt as its parts; `render` lays them out with the template."""

    front: tuple[int, ...] = ()  # a per-request field placed first
    system: tuple[int, ...] = ()
    after_system: tuple[int, ...] = ()  # a per-request field placed after the system prompt
    tools: tuple[tuple[int, ...], ...] = ()
    documents: tuple[tuple[int, ...], ...] = ()
    turns: tuple[tuple[int, ...], ...] = ()  # user, assistant, user, ... contents

    def render(self) -> tuple[int, ...]:
        out = [*self.front, *SYSTEM, *self.system]
        for tool in self.tools:
            out += [*TOOL, *tool]
        out += [*self.after_system, *END]
        for doc in self.documents:
            out += [*DOCUMENT, *doc, *END]
        for i, content in enumerate(self.turns):
            out += [*(USER if i % 2 == 0 else ASSISTANT), *content, *END]
        return (*out, *ASSISTANT)


@dataclass
class Generator:
    """Cases for one shape. `cases(n)` yields n cases, kinds in turn, every size drawn from `seed`."""

    shape: Shape
    seed: int
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def cases(self, count: int) -> Iterator[list[Request]]:
        kinds = self.shape.kinds
        for i in range(count):
            yield getattr(self, "_" + kinds[i % len(kinds)])()

    # --- content ------------------------------------------------------------------------------

    def _tokens(self, low: int, high: int) -> tuple[int, ...]:
        rng = self.rng
        return tuple(rng.randint(TOKEN_LOW, TOKEN_HIGH) for _ in range(rng.randint(low, high)))

    def _sized(self, low: int, high: int) -> tuple[int, ...]:
        """Content of `low` to `high` tokens, scaled to the shape: down to its budget (1,400 tokens is
        1), up with a large hit unit (a 256-token unit is 4) so a chat still spans several units."""
        scale = min(self._budget() / 1400, max(1.0, self.shape.unit / 64))
        return self._tokens(max(int(low * scale), 1), max(int(high * scale), 1))

    def _user(self) -> tuple[int, ...]:
        return self._sized(16, 160)

    def _reply(self) -> tuple[int, ...]:
        opener = self.rng.choice(OPENERS) if self.rng.random() < 0.4 else ()
        return (*opener, *self._sized(24, 256))

    def _chat(self, turns: int | None = None) -> Chat:
        """A fresh chat: a system prompt, 0-2 exchanged turns (or `turns`), a user turn."""
        turns = self.rng.randint(0, 2) if turns is None else turns
        history: list[tuple[int, ...]] = []
        for _ in range(turns):
            history += [self._user(), self._reply()]
        return Chat(system=self._sized(64, 400), turns=(*history, self._user()))

    def _next_turn(self, chat: Chat) -> Chat:
        """The chat with a reply and a user turn appended, together at least a unit and a token (less
        would complete no unit: nothing stored, nothing for the stream to show)."""
        reply, user = self._reply(), self._user()
        short = self.shape.unit + 1 - len(reply) - len(user)
        if short > 0:
            user += self._tokens(short, short)
        return not_whole(replace(chat, turns=(*chat.turns, reply, user)), self.shape.unit)

    def _budget(self) -> int:
        """The longest prompt a case sends: a third of the cache, so a case never evicts its own setup."""
        return min(self.shape.max_prompt, self.shape.capacity_tokens // 3)

    def _fit(self, chat: Chat, room: int = 0) -> Chat:
        """Drop the oldest exchanged turns while the prompt (and `room` tokens more) is over budget."""
        while len(chat.render()) + room > self._budget() and len(chat.turns) > 1:
            chat = replace(chat, turns=chat.turns[2:])
        return chat

    def _then_appended(self, chat: Chat) -> list[Request]:
        """0-2 append-only next turns of `chat` (a short reply and user turn each), scored as cold."""
        out = []
        for _ in range(self.rng.randint(0, 2)):
            longer = self._next_turn(chat)
            if len(longer.render()) > self._budget():
                break
            chat = longer
            out.append(Request(chat.render(), "append_turn", "cold"))
        return out

    def _change(self, kind: str, before: Chat, after: Chat, **extra) -> list[Request]:
        """Setup `before`, then `after` scored as `kind`, then its append-only turns."""
        return [
            Request(before.render(), kind, None),
            Request(after.render(), kind, KINDS[kind][0], **extra),
            *self._then_appended(after),
        ]

    # --- the kinds ------------------------------------------------------------------------------

    def _field_first(self, kind: str, low: int, high: int) -> list[Request]:
        chat = self._fit(self._chat())
        first, second = (
            replace(chat, front=self._tokens(low, high)),
            replace(chat, front=self._tokens(low, high)),
        )
        return self._change(kind, first, second)

    def _timestamp_first(self) -> list[Request]:
        return self._field_first("timestamp_first", 4, 10)

    def _request_id_first(self) -> list[Request]:
        return self._field_first("request_id_first", 6, 14)

    def _uuid_first(self) -> list[Request]:
        return self._field_first("uuid_first", 20, 36)

    def _field_after_system(self) -> list[Request]:
        chat = self._chat(turns=self.rng.randint(1, 2))
        chat = self._fit(replace(chat, documents=(self._sized(48, 256),)), 16)  # room for the field
        first, second = (
            replace(chat, after_system=self._tokens(3, 16)),
            replace(chat, after_system=self._tokens(3, 16)),
        )
        return self._change("field_after_system", first, second)

    def _append_turn(self) -> list[Request]:
        """A new chat, then 1-3 append-only next turns (fewer when the budget runs out)."""
        chat = self._fit(self._chat())
        chat = not_whole(chat, self.shape.unit)
        out = [Request(chat.render(), "append_turn", None)]
        while len(out) < 4:
            longer = self._next_turn(chat)
            if len(longer.render()) > self._budget():
                break
            chat = longer
            out.append(Request(chat.render(), "append_turn", "cold"))
            if self.rng.random() < 0.3:
                break
        return out if len(out) > 1 else [*out, *self._exact_repeat()]

    def _exact_repeat(self) -> list[Request]:
        prompt = not_whole(self._fit(self._chat()), self.shape.unit).render()
        return [Request(prompt, "exact_repeat", None), Request(prompt, "exact_repeat", "hit")]

    def _resent(self, kind: str, before: str) -> list[Request]:
        chat = not_whole(self._fit(self._chat()), self.shape.unit)
        prompt = chat.render()
        return [
            Request(prompt, kind, None),
            Request(prompt, kind, KINDS[kind][0], before=before),
            *self._then_appended(chat),
        ]

    def _cache_reset(self) -> list[Request]:
        return self._resent("cache_reset", "reset")

    def _engine_restart(self) -> list[Request]:
        return self._resent("engine_restart", "restart")

    def _filler(self, total: float) -> list[tuple[int, ...]]:
        """Fresh prompts of 60-90 % of the longest a case sends, `total` tokens or a little more."""
        size = min(self.shape.max_prompt, self.shape.capacity_tokens // 2)
        prompts: list[tuple[int, ...]] = []
        while sum(map(len, prompts)) < total:
            prompts.append(self._tokens(int(0.6 * size), int(0.9 * size)))
        return prompts

    def _capacity_overflow(self) -> list[Request]:
        """Prompts enough for 1.5 caches, each sent twice: the second pass is scored."""
        prompts = self._filler(1.5 * self.shape.capacity_tokens)
        first = [Request(p, "capacity_overflow", None) for p in prompts]
        return [*first, *(Request(p, "capacity_overflow", "evicted") for p in prompts)]

    def _answer_length(self) -> int:
        """A generated answer: 6-10 hit units (the attribution learns generated text from the second
        decode-filled block on), at most a quarter of the budget."""
        unit = self.shape.unit
        return min(self.rng.randint(6 * unit, 10 * unit), self._budget() // 4)

    def _generated(
        self, kind: str, answer: int, rerender: Rerender, opener: tuple[int, ...] = ()
    ) -> list[Request]:
        """A chat whose assistant answer (`answer` tokens after `opener`, the template's start of it)
        the engine generates; the next turn, a short follow-up question, re-rendering it by `rerender`,
        scored; then 0-2 append-only turns, each carrying the answer before it verbatim (the history
        as the scored turn wrote it)."""
        follow_up = (*END, *USER, *self._sized(8, 32), *END, *ASSISTANT)
        chat = self._fit(self._chat(turns=self.rng.randint(0, 2)), answer + len(follow_up) + len(opener))
        out = [
            Request((*chat.render(), *opener), kind, None, answer=answer),
            Request(follow_up, kind, KINDS[kind][0], answer=answer, follows=rerender),
        ]
        length = len(out[0].prompt) + answer + len(follow_up)
        for _ in range(self.rng.randint(0, 2)):
            tail = (*END, *USER, *self._user(), *END, *ASSISTANT)
            length += answer + len(tail)
            if length > self._budget():
                break
            out.append(Request(tail, "append_turn", "cold", answer=answer, follows=VERBATIM))
        return [*out[:-1], replace(out[-1], answer=0)]  # the last one's answer is not carried on

    def _assistant_truncated(self) -> list[Request]:
        """The template drops the reasoning: the answer's first eighth to third."""
        answer = self._answer_length()
        drop = self.rng.randint(max(answer // 8, 1), max(answer // 3, 1))
        return self._generated("assistant_truncated", answer, Rerender(drop=drop))

    def _tool_args_reserialized(self) -> list[Request]:
        """A tool call the model writes (after the template's call opener), its 3-5 arguments written
        back in reverse order (keys sorted another way): the same tokens, another order."""
        answer = self._answer_length()
        cuts = sorted(self.rng.sample(range(2, answer - 1), self.rng.randint(2, 4)))
        return self._generated("tool_args_reserialized", answer, Rerender(cuts=tuple(cuts)), TOOL_CALL)

    def _reordered(self, kind: str, where: str) -> list[Request]:
        count = self.rng.randint(3, 5)
        parts = tuple(self._sized(48, 200) for _ in range(count))
        chat = replace(self._chat(turns=self.rng.randint(0, 1)), **{where: parts})
        order = list(range(count))
        while order == sorted(order):
            self.rng.shuffle(order)
        chat = self._fit(chat)
        return self._change(kind, chat, replace(chat, **{where: tuple(parts[i] for i in order)}))

    def _documents_reranked(self) -> list[Request]:
        return self._reordered("documents_reranked", "documents")

    def _tools_reordered(self) -> list[Request]:
        return self._reordered("tools_reordered", "tools")

    def _other_identity(self) -> list[Request]:
        chat = self._fit(self._chat())
        identity = f"tenant-{self.rng.randint(0, 1)}"
        return [
            Request(chat.render(), "other_identity", None),
            Request(chat.render(), "other_identity", "identity_isolated", identity=identity),
            *(replace(r, identity=identity) for r in self._then_appended(chat)),
        ]

    def _short_shared_prefix(self) -> list[Request]:
        """Two prompts of one unit and a bit that share their first 50-90 % of a unit: no hit is possible."""
        unit = self.shape.unit
        shared = self._tokens(unit // 2, unit * 9 // 10)
        rest = lambda: self._tokens(unit - len(shared) + 1, unit - len(shared) + unit // 4)  # noqa: E731
        return [
            Request((*shared, *rest()), "short_shared_prefix", None),
            Request((*shared, *rest()), "short_shared_prefix", "below_hit_unit"),
        ]

    def _window_dropped(self) -> list[Request]:
        """A prompt, then half a cache of others, then the prompt again. A hybrid model frees the
        blocks a sliding window has left as it goes, ahead of the full-attention ones, so those go
        first: the full part is held, its window part is not. (No backend here runs it yet.)"""
        prompt = not_whole(self._fit(self._chat()), self.shape.unit).render()
        if self.shape.fill_by_events:  # the backend fills until its events show the window part gone
            fill = [Request((), "window_dropped", None, before="drop_window")]  # sends no prompt of its own
        else:
            half = self._filler(0.5 * self.shape.capacity_tokens)
            fill = [Request(p, "window_dropped", None) for p in half]
        return [
            Request(prompt, "window_dropped", None),
            *fill,
            Request(prompt, "window_dropped", "window_expired"),
        ]

    def _host_tier_load(self) -> list[Request]:
        """A prompt, then others until the GPU cache has turned over (the host tier, larger, keeps it),
        then the prompt again."""
        prompt = not_whole(self._fit(self._chat()), self.shape.unit).render()
        fill = [Request(p, "host_tier_load", None) for p in self._filler(1.2 * self.shape.capacity_tokens)]
        return [
            Request(prompt, "host_tier_load", None),
            *fill,
            Request(prompt, "host_tier_load", "tier_restored"),
        ]


def not_whole(chat: Chat, unit: int) -> Chat:
    """The chat, its last turn a token longer when its prompt is whole units: vLLM recomputes the last
    unit of a fully cached prompt (it needs the last token's logits), so only such a prompt can be all
    hit, and an append-only next turn is then a pure extension."""
    if len(chat.render()) % unit:
        return chat
    return replace(chat, turns=(*chat.turns[:-1], (*chat.turns[-1], TOKEN_LOW)))
