"""One line chart for the benchmark scripts, drawn with Pillow (no plotting dependency): evenly
spaced x values, a line with dots per series, its label at the line's end."""

from __future__ import annotations

COLORS = ["#4363d8", "#911eb4", "#3cb44b", "#f58231", "#e6194b"]


def line_plot(path: str, title: str, xs: list, series: dict, xlabel: str, ref: tuple | None = None,
              every: int = 1, colors: list = COLORS) -> None:
    """``series``: label -> one y value per x; ``ref``: (y, label) drawn as a gray horizontal
    line; ``every``: label every n-th x. End labels closer than a line of text are pushed apart."""
    from PIL import Image, ImageDraw

    W, H, left, right, top, bottom = 760, 420, 70, 220, 40, 50
    im = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(im)
    d.text((left, 12), title, fill="black")
    ymax = max([v for vals in series.values() for v in vals] + ([ref[0]] if ref else [])) * 1.1

    def px(i):
        return left + (W - left - right) * i / max(1, len(xs) - 1)

    def py(v):
        return H - bottom - (H - top - bottom) * v / ymax

    d.line((left, top, left, H - bottom), fill="black")
    d.line((left, H - bottom, W - right, H - bottom), fill="black")
    for k in range(6):
        v = ymax * k / 5
        d.line((left - 4, py(v), left, py(v)), fill="black")
        d.text((8, py(v) - 6), f"{v:.0f}", fill="black")
    for i, x in enumerate(xs):
        if i % every == 0:
            d.text((px(i) - 6, H - bottom + 6), str(x), fill="black")
    d.text(((left + W - right) / 2 - 50, H - bottom + 24), xlabel, fill="black")
    if ref:
        d.line((left, py(ref[0]), W - right, py(ref[0])), fill="gray")
        d.text((W - right + 8, py(ref[0]) - 6), ref[1], fill="gray")
    ends = []
    for (label, vals), c in zip(series.items(), colors):
        pts = [(px(i), py(v)) for i, v in enumerate(vals)]
        d.line(pts, fill=c, width=3)
        for x, y in pts:
            d.ellipse((x - 4, y - 4, x + 4, y + 4), fill=c)
        ends.append([pts[-1][1] - 6, label, c])
    ends.sort()
    for a, b in zip(ends, ends[1:]):
        b[0] = max(b[0], a[0] + 14)
    for y, label, c in ends:
        d.text((W - right + 8, y), label, fill=c)
    im.save(path)
