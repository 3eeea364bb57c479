"""MK_NOFENCE's counted fixed-point residual words (flint/kernels/megakernel.cu, `fx_counted` and the staging's decode),
emulated in 64-bit wrap-around arithmetic: a word is the sum of its adds, each carrying 2^56 plus a two's-complement
fixed-point value; a reader expecting E adds accepts the word only when it is within 2^55 of E * 2^56, and then reads the
value as word - E * 2^56. Checked: every complete word decodes to the exact sum; a word missing any number of adds
(1..nffn) is refused, whatever the adds' values and order; a value near the format's bound still decodes."""
import random

import numpy as np

MASK = (1 << 64) - 1
FX_SCALE = 1 << 32


def fx_of(v: float) -> int:  # __float2ll_rn(v * 2^32) as an unsigned 64-bit pattern
    return int(round(v * FX_SCALE)) & MASK


def fx_counted(w: int, e: int) -> bool:  # the kernel's test, e = expected count (mod 256)
    return ((w - ((e & 255) << 56) + (1 << 55)) & MASK) < (1 << 56)


def decode(w: int, e: int) -> int:
    d = (w - ((e & 255) << 56)) & MASK
    return d - (1 << 64) if d >> 63 else d


def word(store: float, adds: list[float]) -> int:
    w = fx_of(store)  # the owner's store: count 0
    for a in adds:
        w = (w + (1 << 56) + fx_of(a)) & MASK
    return w


def test_complete_words_decode_exactly():
    rng = random.Random(1)
    for nffn in (1, 2, 7, 96, 128, 132, 255):
        for _ in range(200):
            store = rng.uniform(-300.0, 300.0)
            adds = [rng.uniform(-4.0, 4.0) for _ in range(nffn)]
            w = word(store, adds)
            assert fx_counted(w, nffn)
            exact = sum((round(a * FX_SCALE) for a in adds), round(store * FX_SCALE))
            assert decode(w, nffn) == exact


def test_a_missing_add_is_refused():
    rng = random.Random(2)
    for nffn in (1, 3, 128, 132, 255):
        for _ in range(200):
            store = rng.uniform(-300.0, 300.0)
            adds = [rng.uniform(-4.0, 4.0) for _ in range(nffn)]
            rng.shuffle(adds)
            k = rng.randint(1, nffn)  # adds not landed yet
            assert not fx_counted(word(store, adds[: nffn - k]), nffn)


def test_the_value_range_of_the_format():
    # |value| < 2^55 / 2^32 = 2^23 decodes; the residuals flint runs are orders of magnitude below it
    big = float(2 ** 22)
    for nffn in (1, 128, 255):
        w = word(big, [1.0] * nffn)
        assert fx_counted(w, nffn) and decode(w, nffn) == round((big + nffn) * FX_SCALE)
        w = word(-big, [-1.0] * nffn)
        assert fx_counted(w, nffn) and decode(w, nffn) == round((-big - nffn) * FX_SCALE)
        assert not fx_counted(word(big, [1.0] * (nffn - 1)), nffn)


# MK_NOFENCE bit 8's 32-bit tagged words (megakernel.cu `tw24_word`, `ld_tw24x8`): the fp32 value's top 3 bytes and the
# tag's low byte; a reader accepts a word whose low byte is its tag's, and reads the value with that byte cleared.
def tw24_word(v: float, tag: int) -> int:
    bits = int(np.float32(v).view(np.uint32))
    return (bits & 0xFFFFFF00) | (tag & 0xFF)


def tw24_value(w: int) -> float:
    return float(np.uint32(w & 0xFFFFFF00).view(np.float32))


def test_tagged_words_keep_16_significant_bits():
    rng = np.random.default_rng(3)
    v = np.concatenate([rng.standard_normal(4000) * s for s in (1e-3, 1.0, 30.0, 3e3)]).astype(np.float32)
    for x in v:
        y = tw24_value(tw24_word(float(x), 77))
        assert abs(y - float(x)) <= abs(float(x)) * 2.0 ** -15
        assert np.sign(y) == np.sign(x) or y == 0.0


def test_a_stale_word_is_refused():
    # every word is rewritten each layer and the tag grows by one per layer: this layer's tag never matches the last's
    for tag in range(1, 3 * 256 + 2):
        stale = tw24_word(1.5, tag - 1)
        assert (stale & 0xFF) != (tag & 0xFF)
        assert (tw24_word(1.5, tag) & 0xFF) == (tag & 0xFF)
    # a zeroed buffer (the first launch) holds tag 0; the first layer's tag is 1
    assert (0 & 0xFF) != (1 & 0xFF)
