"""Proof machinery: drives the real sglang code to show each bug and each fix.

Not part of the fix itself: the product (``width``, ``release``, ``tree``, ``source_patch``,
``runtime_fix``, ``plugin``, ``status``, ``cli``) imports none of this and no torch at import.
The tests, the demo and the benchmarks use it.
"""
