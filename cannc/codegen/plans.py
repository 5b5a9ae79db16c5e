"""The plans of the contraction kernels as the lowerings record them, and the tuned
plan of a GEMM.

A lowering writes ``kernel.notes["plan"]`` (a plain dict: the GEMM or attention
plan it chose) and ``kernel.notes["tiling"]`` (schedule.costmodel.describe of
it); the cost model predicts from the record and `cannc tune` reads the GEMM
signature from it. `gemm_tuning` is the lookup in the tuning cache that the GEMM
lowerings use: a stored tuning only if the planner still accepts it.
"""

from __future__ import annotations

import warnings
from typing import Any

from ..native.target import host
from ..schedule import tuning
from ..schedule.costmodel import describe
from ..schedule.tuning import gemm_signature
from .attention import AttnSpec, attention_plan
from .gemm import GemmSpec, dpbf16_speedup, gemm_plan

__all__ = ["attention_notes", "attention_record", "gemm_notes", "gemm_record",
           "gemm_spec_of", "gemm_tuning", "precision_record"]


def gemm_record(spec: GemmSpec, tuning: dict[str, Any] | None = None,
                epilogue: bool = False) -> dict[str, Any]:
    """The plan of a GEMM as a plain dict (kernel.notes['plan'])."""
    p = gemm_plan(spec, tuning)
    return {"kind": "gemm", "M": spec.M, "N": spec.N, "K": spec.K, "batch": spec.batch,
            "MR": p.MR, "NR": p.NR, "NV": p.NV, "KC": p.KC, "MC": p.MC, "NC": p.NC,
            "MB": p.MB, "NB": p.NB, "mt": p.mt, "nt": p.nt, "b_mode": p.b_mode,
            "pack_a": p.pack_a, "pack_b": p.b_mode == "pack", "tiles": p.num_tiles(spec.batch),
            "workspace_bytes": p.ws_bytes, "tuning": dict(tuning) if tuning else None,
            "signature": gemm_signature(spec, epilogue), **precision_record(spec, p)}


def precision_record(spec: GemmSpec, p: Any) -> dict[str, Any]:
    """The compute precision of a GEMM plan and, with vdpbf16ps, its measured speedup over
    fp32 FMA (the cost model scales the GEMM's peak by it)."""
    return {"compute": spec.compute, "dp": p.dp,
            "dp_speedup": dpbf16_speedup(host().features) if p.dp else 1.0}


def gemm_notes(spec: GemmSpec, tuning: dict[str, Any] | None = None,
               epilogue: bool = False) -> dict[str, Any]:
    """What a GEMM lowering records: notes['plan'] (the plan) and notes['tiling']."""
    rec = gemm_record(spec, tuning, epilogue)
    return {"plan": rec, "tiling": describe(rec)}


def attention_record(spec: Any, plan: Any, tuning: dict[str, Any] | None = None
                     ) -> dict[str, Any]:
    """The plan of a fused attention (an AttnSpec, or a tiling's spec) as a plain dict."""
    return {"kind": "attention", "B": spec.B, "H": spec.H, "Sq": spec.Sq, "Sk": spec.Sk,
            "D": spec.D, "Dv": spec.Dv, "MQ": plan.MQ, "KB": plan.KB, "MR_s": plan.MR_s,
            "NV_s": plan.NV_s, "MR_v": plan.MR_v, "k_mode": plan.k_mode, "v_mode": plan.v_mode,
            "scope": plan.scope, "tiles": plan.num_tiles(spec),
            "tuning": dict(tuning) if tuning else None}


def attention_notes(spec: AttnSpec, tuning: dict[str, Any] | None = None) -> dict[str, Any]:
    rec = attention_record(spec, attention_plan(spec, tuning), tuning)
    return {"plan": rec, "tiling": describe(rec)}


def gemm_spec_of(signature: dict[str, Any]) -> GemmSpec:
    """The GemmSpec a gemm signature (schedule.tuning.gemm_signature) stands for
    (alpha = beta = 1)."""
    return GemmSpec(**{k: v for k, v in signature.items() if k != "epilogue"})


def gemm_tuning(spec: GemmSpec, epilogue: bool = False) -> dict[str, Any] | None:
    """The cached tuning of this GEMM if there is one and the planner accepts it (a stale
    or edited entry that no longer plans is ignored with a warning)."""
    tun = tuning.lookup("gemm", gemm_signature(spec, epilogue))
    if tun is None:
        return None
    try:
        gemm_plan(spec, tun)
    except Exception as e:
        warnings.warn(f"ignoring tuning {tun} of GEMM {spec.M}x{spec.N}x{spec.K}: {e}",
                      RuntimeWarning, stacklevel=2)
        return None
    return tun
