"""Speculative decoding: a cheap draft guesses k tokens, the target verifies them in one
pass, and an acceptance rule keeps the output exactly the target's.

    rejection.py  rejection_sample: the acceptance rule (lossless sampling)
    drafts.py     NgramDraft (prompt lookup), ModelDraft, LayerSkipDraft
    lookahead.py  LookaheadDraft: the target's own earlier passes (Jacobi window, n-gram pool)
    decode.py     speculative_generate -> SpecOutput (tokens, passes, acceptance rate)
    distill.py    make_draft / distill: train a tiny draft from the target (KL on real text)

The expected tokens per pass and the speedup are `calc.spec_expected_tokens` and
`calc.spec_speedup`.
"""
from .decode import SpecOutput, speculative_generate
from .drafts import LayerSkipDraft, ModelDraft, NgramDraft
from .lookahead import LookaheadDraft
from .rejection import rejection_sample

__all__ = ["rejection_sample", "speculative_generate", "SpecOutput", "NgramDraft",
           "ModelDraft", "LayerSkipDraft", "LookaheadDraft"]
