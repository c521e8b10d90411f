"""`analyze --html`: the page rendered by Debian's real chromium (headless), its plots checked in pixels."""

from __future__ import annotations

import html
import json
import re
import shutil
import struct
import subprocess
import sys
import zlib

from kvcache_exporter.analyzer.html import CAUSE_COLORS, COLORS, VERDICT_COLOR

from .traces import chat_lines

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def read_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and RGB(A) rows of an 8-bit truecolour PNG (what chromium writes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks, header = 8, [], None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + length]
        header = body if kind == b"IHDR" else header
        chunks += [body] if kind == b"IDAT" else []
        pos += 12 + length
    width, height, depth, colour = struct.unpack(">IIBB", header[:10])
    assert depth == 8 and colour in (2, 6)
    bpp = 3 if colour == 2 else 4
    raw, stride, rows, prev = zlib.decompress(b"".join(chunks)), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - bpp] if i >= bpp else 0
            up, corner = prev[i], prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + left) & 255
            elif kind == 2:
                line[i] = (line[i] + up) & 255
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 255
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, [bytes(r[i : i + 3]) for r in rows for i in range(0, stride, bpp)]


def test_the_page_draws_every_plot_in_a_real_browser(seed_trace_path, tmp_path):
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is needed: apt-get install -y chromium"
    page = tmp_path / "report.html"
    argv = [sys.executable, "-m", "kvcache_exporter.analyzer", str(seed_trace_path), "--block-size", "32"]
    out = subprocess.run(
        [*argv, "--num-gpu-blocks", "96", "--replicas", "2", "--html", str(page)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    text = page.read_text()
    assert "http" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")  # nothing to fetch
    png = tmp_path / "report.png"
    subprocess.run(
        [
            chromium,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={tmp_path / 'profile'}",
            "--window-size=720,3600",
            f"--screenshot={png}",
            page.as_uri(),
        ],
        capture_output=True,
        timeout=60,
        check=True,
    )
    _, _, pixels = read_png(png.read_bytes())
    counts: dict[bytes, int] = {}
    for pixel in pixels:
        counts[pixel] = counts.get(pixel, 0) + 1
    for plot, colour in COLORS.items():
        rgb = bytes.fromhex(colour[1:])
        assert counts.get(rgb, 0) > 300, f"the {plot} plot is not drawn"
    causes = re.findall(r"<text[^>]*>(\w+)</text><rect[^>]*fill=\"(#\w+)\"", text)
    drawn = {cause: colour for cause, colour in causes if cause in CAUSE_COLORS}
    assert drawn == CAUSE_COLORS  # one colour per cause, each its own
    assert counts[b"\xff\xff\xff"] > len(pixels) // 3  # and the background is the page's


def chromium_run(page, tmp_path, *flags: str) -> subprocess.CompletedProcess:
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is needed: apt-get install -y chromium"
    argv = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,900"]
    return subprocess.run(
        [*argv, *flags, page.as_uri()], capture_output=True, text=True, timeout=60, check=True
    )


PROBE = """<script>
const box = (el) => el.getBoundingClientRect();
const diagnosis = document.getElementById("diagnosis");
const time = [...document.querySelectorAll("figure")].find((f) => f.textContent.startsWith("Hit ratio over"));
document.body.setAttribute("data-layout", JSON.stringify({
  viewport: [innerWidth, innerHeight],
  diagnosis: [diagnosis.textContent, box(diagnosis).bottom],
  worth: [document.querySelector(".worth").textContent, box(document.querySelector(".worth")).bottom],
  action: box(document.querySelector("#verdict li")).bottom,
  plots: [...document.querySelectorAll("figure svg")].map((svg) => box(svg).width),
  timeTicks: [...time.querySelectorAll("text")].map((t) => t.textContent),
}));
</script></body>"""


def test_the_diagnosis_is_on_the_first_screen(tmp_path):
    """A chat trace with a timestamp and a customer id first in the system message, at 1400x900 in real
    chromium: the diagnosis, its worth and the first action lie inside the first viewport (measured by the
    browser's layout), the verdict's rule is in the first screenshot, every plot spans the page."""
    trace = tmp_path / "chat.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in chat_lines(200, "timestamp")))
    page = tmp_path / "report.html"
    argv = [sys.executable, "-m", "kvcache_exporter.analyzer", str(trace), "--num-gpu-blocks", "512"]
    out = subprocess.run([*argv, "--html", str(page)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text().replace("</body>", PROBE))
    dom = chromium_run(probe, tmp_path, "--dump-dom").stdout
    layout = json.loads(html.unescape(re.search(r'data-layout="([^"]*)"', dom).group(1)))
    width, height = layout["viewport"]
    title, bottom = layout["diagnosis"]
    assert title == "per-request fields come before the shared content" and bottom < height
    worth, bottom = layout["worth"]
    assert re.fullmatch(r"hit ratio 0\.9\d\d instead of 0\.0\d\d \(\+0\.9\d\d\)", worth) and bottom < height
    assert layout["action"] < height
    assert layout["plots"] and min(layout["plots"]) > 0.9 * width
    x_ticks = [t for t in layout["timeTicks"] if t.isdigit()][-6:]  # after the y axis' 0 and 1
    assert x_ticks == ["0", "40", "80", "119", "159", "199"]  # request order: 200 requests
    png = tmp_path / "first-screen.png"
    chromium_run(page, tmp_path, f"--screenshot={png}")
    width, height, pixels = read_png(png.read_bytes())
    rule = bytes.fromhex(VERDICT_COLOR[1:])
    rows = {n // width for n, pixel in enumerate(pixels) if pixel == rule}
    assert len(rows) > 200 and max(rows) < height  # the verdict, 200+ pixels tall, on the first screen
