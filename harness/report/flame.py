"""A memray capture drawn as a flame graph in plain SVG, so the report renders with no network.

memray's own ``memray flamegraph`` HTML loads d3 and its styles from a CDN; this draws the same
picture (the allocations alive at the capture's high-water mark, by stack) as one ``<svg>`` with
``<title>`` tooltips. Frames are the Python frames, libllama/ggml's native frames and the innermost
allocator call; the interpreter's own C frames between them are dropped so a stack reads as code the
reader knows. Everything above the first frame of the project (``harness/``, ``properties/``) is cut:
the stack starts where the measured operation starts.
"""

from __future__ import annotations

import html
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import memray

__all__ = ["flame_stacks", "flame_svg"]

_PROJECT = ("/harness/", "/properties/", "/faults/")
_NATIVE = ("llama", "ggml", "common_", "malloc", "calloc", "realloc", "posix_memalign", "operator new", "mmap")


@dataclass
class _Node:
    name: str
    size: int = 0
    children: dict[str, _Node] = field(default_factory=dict)


def _keep(fn: str, path: str, innermost: bool) -> bool:
    return path.endswith(".py") or fn.startswith(_NATIVE) or innermost


def flame_stacks(capture: Path) -> list[tuple[list[str], int]]:
    """(stack root first, bytes) of every allocation alive at the capture's peak."""
    reader = memray.FileReader(str(capture))
    out: list[tuple[list[str], int]] = []
    for rec in reader.get_high_watermark_allocation_records(merge_threads=True):
        frames = rec.hybrid_stack_trace()  # innermost first
        kept = [
            f"{fn} ({Path(path).name}:{line})" if path.endswith(".py") else fn
            for i, (fn, path, line) in enumerate(frames)
            if _keep(fn, path, i == 0)
        ][::-1]
        paths = [p for _fn, p, _l in frames if p.endswith(".py")][::-1]
        start = next((i for i, p in enumerate(paths) if any(s in p for s in _PROJECT)), 0)
        out.append((kept[start:] if start < len(kept) else kept, int(rec.size)))
    return out


def _tree(stacks: list[tuple[list[str], int]]) -> _Node:
    root = _Node("all")
    for frames, size in stacks:
        root.size += size
        node = root
        for name in frames:
            node = node.children.setdefault(name, _Node(name))
            node.size += size
    return root


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB" if n >= 1 << 16 else f"{n} B"


def flame_svg(capture: Path, *, title: str, width: int = 1100, row: int = 17, max_depth: int = 30) -> str:
    """The flame graph of ``capture`` as an SVG string (icicle layout: the root on top)."""
    root = _tree(flame_stacks(capture))
    rects: list[str] = []
    depth_seen = 0
    todo: list[tuple[_Node, float, int]] = [(root, 0.0, 0)]
    scale = (width - 2) / max(root.size, 1)
    while todo:  # bounded: every node is drawn once, and at most max_depth rows
        node, x, depth = todo.pop()
        w = node.size * scale
        if w < 0.5 or depth >= max_depth:
            continue
        depth_seen = max(depth_seen, depth)
        y = 24 + depth * row
        hue = 20 + (zlib.crc32(node.name.encode()) % 40)
        label = html.escape(node.name)
        text = label if len(node.name) * 6.5 < w - 4 else html.escape(node.name[: max(0, int((w - 4) / 6.5) - 1)])
        rects.append(
            f'<g><title>{label}: {_mib(node.size)}</title>'
            f'<rect x="{x + 1:.1f}" y="{y}" width="{max(w - 0.5, 0.5):.1f}" height="{row - 1}" '
            f'fill="hsl({hue},85%,60%)" rx="2"/>'
            + (f'<text x="{x + 3:.1f}" y="{y + row - 5}">{text}</text>' if text else "")
            + "</g>"
        )
        cx = x
        for child in sorted(node.children.values(), key=lambda c: -c.size):
            todo.append((child, cx, depth + 1))
            cx += child.size * scale
    height = 24 + (depth_seen + 1) * row + 4
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="flame" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="monospace" font-size="11">'
        f'<text x="2" y="15" font-size="13">{html.escape(title)}: {_mib(root.size)} alive at the peak</text>'
        + "".join(rects)
        + "</svg>"
    )
