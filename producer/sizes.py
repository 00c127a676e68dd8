"""Size buckets: many requested sizes, a few generated ones (one compile each).

A row's requested (height, width) goes to the bucket with the nearest aspect ratio,
compared as |log(h/w) - log(bh/bw)|, ties to the larger area, then to the bucket
listed first. Distances are compared as exact fractions, so a requested size halfway
(in log terms) between two buckets is a tie, not a rounding accident.
"""

from __future__ import annotations

import bisect
import functools
import math
import re
from fractions import Fraction

# Named sets, HxW. `aspect-1024` is the common ~1 megapixel aspect-ratio set (the SDXL
# training buckets); the smaller sets are it scaled by 1/2 and 1/4, every side still a
# multiple of 16.
PRESETS: dict[str, tuple[tuple[int, int], ...]] = {
    "aspect-1024": ((1024, 1024), (1152, 896), (896, 1152), (1216, 832), (832, 1216),
                    (1344, 768), (768, 1344), (1536, 640), (640, 1536)),
    "aspect-512": ((512, 512), (576, 448), (448, 576), (608, 416), (416, 608),
                   (672, 384), (384, 672), (768, 320), (320, 768)),
    "aspect-256": ((256, 256), (288, 224), (224, 288), (304, 208), (208, 304),
                   (336, 192), (192, 336), (384, 160), (160, 384)),
}
MAX_SIDE = 16384
_SIZE = re.compile(r"^(\d+)x(\d+)$")
# Far above the float error of a log distance: every bucket this close to the best
# one is compared again exactly, so ties and near-ties are decided by fractions.
_ROUNDING = 1e-9


class BucketSpecError(ValueError):
    """A bad --size-buckets value: names the token and what is wrong with it."""

    def __init__(self, token: str, message: str):
        super().__init__(f"--size-buckets: '{token}': {message}")


def _aspect(height: int, width: int) -> Fraction:
    return Fraction(height, width)


class SizeBuckets:
    """A parsed, checked set of buckets; `nearest` is cached per requested size."""

    def __init__(self, sizes: tuple[tuple[int, int], ...], spec: str):
        self.sizes = sizes
        self.spec = spec
        # Sorted by log aspect ratio (all distinct: parse_buckets refuses repeats), so
        # the nearest bucket is one of the two around a requested ratio.
        self._order = sorted(range(len(sizes)), key=lambda i: math.log(sizes[i][0] / sizes[i][1]))
        self._logs = [math.log(sizes[i][0] / sizes[i][1]) for i in self._order]
        self.nearest = functools.lru_cache(maxsize=65536)(self._nearest)

    def _nearest(self, height: int, width: int) -> tuple[int, int]:
        # Real sizes are often nearly all distinct, so this runs per row: floats pick
        # the neighbour; exact fractions decide when the two are within rounding.
        logs = self._logs
        asked = math.log(height / width)
        at = bisect.bisect_left(logs, asked)
        if at == 0:
            return self.sizes[self._order[0]]
        if at == len(logs):
            return self.sizes[self._order[-1]]
        below, above = asked - logs[at - 1], logs[at] - asked
        if abs(below - above) > _ROUNDING:
            return self.sizes[self._order[at - 1 if below < above else at]]
        ratio = Fraction(height, width)

        def key(index: int):
            bh, bw = self.sizes[index]
            r = ratio / Fraction(bh, bw)
            return r if r >= 1 else 1 / r, -bh * bw, index  # exp(|log r|), exact

        return self.sizes[min(self._order[at - 1:at + 1], key=key)]

    def __repr__(self) -> str:
        return f"SizeBuckets({self.spec!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, SizeBuckets) and self.sizes == other.sizes

    def __hash__(self) -> int:
        return hash(self.sizes)


def parse_buckets(spec: str, multiple: int = 16) -> SizeBuckets:
    """`HxW,HxW,…` and/or preset names (`aspect-1024`, …), comma-separated."""
    sizes: list[tuple[int, int]] = []
    tokens = [token.strip() for token in spec.split(",")]
    if not any(tokens):
        raise BucketSpecError(spec, f"empty; give HxW[,HxW…] or a preset ({', '.join(PRESETS)})")
    for token in tokens:
        if not token:
            raise BucketSpecError(spec, "empty entry between commas")
        if token.lower() in PRESETS:
            found = PRESETS[token.lower()]
        else:
            match = _SIZE.match(token.lower())
            if match is None:
                raise BucketSpecError(token, f"not HxW (e.g. 1024x1024) nor a preset ({', '.join(PRESETS)})")
            found = ((int(match[1]), int(match[2])),)
        for height, width in found:
            for side in (height, width):
                if not 0 < side <= MAX_SIDE:
                    raise BucketSpecError(token, f"{side} is outside 1..{MAX_SIDE}")
                if side % multiple:
                    raise BucketSpecError(token, f"{side} is not a multiple of {multiple}")
            same = [s for s in sizes if _aspect(*s) == _aspect(height, width)]
            if (height, width) in sizes:
                raise BucketSpecError(token, f"{height}x{width} is listed twice")
            if same:
                raise BucketSpecError(token, f"{height}x{width} has the aspect ratio of {same[0][0]}x{same[0][1]}: "
                                             "only the larger of the two would ever be used")
            sizes.append((height, width))
    return SizeBuckets(tuple(sizes), spec)
