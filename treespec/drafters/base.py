"""The drafter interface, re-exported where drafters were written against it: it lives in `core.drafting`
(beside the decoder that calls it)."""

from ..core.drafting import (
    BaseDrafter,
    Drafter,
    DrafterReport,
    Proposal,
    RootOnlyDrafter,
    Scorer,
    SequenceStart,
    StepTrees,
    batch_rows,
    single_row,
)

__all__ = [
    "BaseDrafter",
    "Drafter",
    "DrafterReport",
    "Proposal",
    "RootOnlyDrafter",
    "Scorer",
    "SequenceStart",
    "StepTrees",
    "batch_rows",
    "single_row",
]
