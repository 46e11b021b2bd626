"""The decoder a sequence runs with, built from its options: the constraint that holds its tokens to a
format or tool-call grammar, and, when it drafts, its speculative decoder."""

from __future__ import annotations

from ..models.prompt_cache import PromptCache
from ..text.constrain import Constraint, response_format
from ..decode.sources import Stats
from .options import GenerationOptions
from ..decode.sample import Sampler
from ..decode.speculative import (
    LOOKUP_DRAFT,
    MODEL_DRAFT,
    PREDICTION_DRAFT,
    PredictedOutput,
    SpeculativeDecoder,
    make_drafter,
)
from ..text.tokenizer import Tokenizer
from ..text.tools import ToolPlan


def constraint_for(options: GenerationOptions, tokenizer: Tokenizer, vocab_size: int,
                   tools: ToolPlan | None = None) -> Constraint | None:
    """A fresh matcher for the options' tool calls (and the format a reply may answer in
    instead) or their response format, if they ask for one."""
    if tools is not None and tools.grammar is not None:
        return tools.constraint(tokenizer, vocab_size)
    fmt = response_format(options.response_format)
    return Constraint(fmt, tokenizer, vocab_size) if fmt is not None else None


def speculative_source(model, cache: PromptCache, sampler: Sampler, last: int, limit: int,
                       options: GenerationOptions, stats: Stats, constraint: Constraint | None = None,
                       prediction: PredictedOutput | None = None) -> SpeculativeDecoder:
    """Speculative decoding with the drafter asked for: a `prediction` first (it is what the
    caller expects this very output to be), else the options' draft model or prompt lookup;
    held to `constraint` when there is one."""
    o = options
    if prediction is not None:
        drafter, max_draft = prediction, o.num_draft_tokens or PREDICTION_DRAFT
    else:
        drafter = make_drafter(model, sampler, o.draft_model, o.draft_cache, constraint,
                               max_kv_size=o.max_kv_size, kv_bits=o.kv_bits, kv_group_size=o.kv_group_size)
        max_draft = o.num_draft_tokens or (LOOKUP_DRAFT if o.prompt_lookup else MODEL_DRAFT)
    return SpeculativeDecoder(model, cache, sampler, drafter, last, limit, stats, max_draft, constraint=constraint)
