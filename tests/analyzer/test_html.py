"""`analyze --html`: the page rendered by Debian's real chromium (headless), its plots checked in pixels."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
import zlib

from kvcache_exporter.analyzer.html import COLORS

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
            "--window-size=720,1800",
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
    assert counts[b"\xff\xff\xff"] > len(pixels) // 3  # and the background is the page's
