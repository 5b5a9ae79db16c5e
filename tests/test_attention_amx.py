"""Fused attention with dot 'amx' (codegen/attention.py): bf16 Q K^T and P V on AMX tiles
(tdpbf16ps, fp32 accumulation), the online softmax in fp32 vector code between them, P
rounded to bf16. Compared with a float64 reference from the SAME bf16-rounded inputs,
within the P-rounding bound of tests/test_attention_lowp.py (Case.check). Skipped where
AMX is not usable (`amx.amx_usable` says why)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.abspath(os.path.dirname(os.path.dirname(__file__))))

from cannc.codegen.amx import amx_usable
from cannc.codegen.attention import attention_plan, attention_precision_note
from tests.test_attention_lowp import BF, Case, spec

WHY = amx_usable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"AMX not usable: {WHY}")
AMX = {"dot": "amx"}
F32 = ("float32",) * 4


def check(s, seed=0, form=False, tuning=AMX, mask_fn=None):
    assert attention_plan(s, tuning).dot == "amx"
    return Case(s, seed=seed, mask_fn=mask_fn).check(tuning, form=form)


@pytest.mark.parametrize("shape", [(1, 2, 32, 64, 64, 64), (2, 1, 37, 53, 64, 64),
                                   (1, 1, 20, 150, 33, 17), (1, 3, 70, 29, 80, 80),
                                   (1, 1, 5, 7, 16, 1)])
def test_bf16_qkv(shape):
    check(spec(*shape, dtypes=BF))


@pytest.mark.parametrize("odt", ["float32", "bfloat16"])
def test_fp32_inputs_with_bf16_precision(odt):
    """float32 operands converted to bf16 while packed into the tile layouts."""
    s = spec(2, 2, 33, 70, 64, 48, dtypes=("float32",) * 3 + (odt,))
    got, ref = check(s, seed=3)
    assert np.abs(got - ref).max() > 1e-6    # products of bf16: not the fp32 result


def test_default_and_note():
    s = spec(1, 2, 64, 64, 64, dtypes=F32)
    assert attention_plan(s).dot == "amx"
    assert attention_precision_note(s) == "bf16 AMX (P rounded to bf16), fp32 softmax"
    assert attention_precision_note(spec(1, 1, 32, 32, 64)).endswith("(bfloat16 storage)")
    # fp32 precision, fp16 operands, strided Q, few query rows: not on tiles
    assert attention_plan(spec(1, 1, 32, 32, 64, dtypes=F32, precision="fp32")).dot == "f32"
    assert attention_plan(spec(1, 1, 32, 32, 64, dtypes=("float16",) * 4,
                               precision="fp16")).dot == "f32"
    assert attention_plan(spec(1, 1, 4, 32, 64)).dot != "amx"
    with pytest.raises(ValueError, match="dot 'amx'"):
        attention_plan(spec(1, 1, 32, 32, 64, dtypes=("float16",) * 4), AMX)


@pytest.mark.parametrize("mdt", ["bool", "float32", "bfloat16"])
def test_masks(mdt):
    mode = "where" if mdt == "bool" else "add"
    s = spec(2, 2, 24, 45, 64, mask=mode, mask_dtype=mdt,
             mask_strides=(2 * 24 * 45, 24 * 45, 45, 1), fill=float("-inf"))
    check(s, seed=5)


def test_padding_mask_broadcast_and_neg_inf_rows():
    """A [B, 1, 1, Sk] padding mask (BERT) and rows whose keys are all -inf (NaN, as
    numpy)."""
    B, H, S = 2, 2, 40

    def pad(rng, n):
        m = np.zeros(n, np.float32)
        m[30:] = -np.inf            # batch 0: keys 30.. masked; batch 1 all masked
        m[S:] = -np.inf
        return m

    s = spec(B, H, S, S, 64, dtypes=F32, mask="add", mask_dtype="float32",
             mask_strides=(S, 0, 0, 1))
    check(s, seed=2, mask_fn=pad)     # NaN rows where the reference has them
    ref, _ = Case(s, seed=2, mask_fn=pad).reference("bfloat16")
    assert np.isnan(ref[1]).all() and np.isfinite(ref[0]).all()


@pytest.mark.parametrize("Sq,Sk", [(40, 40), (70, 100), (33, 5), (20, 17)])
def test_causal(Sq, Sk):
    check(spec(1, 2, Sq, Sk, 64, causal=True), seed=6)


@pytest.mark.parametrize("dts", [BF, F32])
@pytest.mark.parametrize("shape", [(1, 2, 37, 53, 64, 64), (2, 1, 20, 140, 33, 24)])
def test_k_stored_transposed(dts, shape):
    """K as [B, H, D, Sk] (key stride 1), as BERT exports it; also the form."""
    s = spec(*shape, dtypes=dts, k_transposed=True)
    assert s.k_strides[2] == 1
    check(s, seed=9)
    check(s, seed=9, form=True)


@pytest.mark.parametrize("shape", [(1, 2, 37, 53, 64, 64), (2, 1, 5, 300, 33, 40)])
def test_shape_polymorphic_form(shape):
    B, H, Sq, Sk = shape[:4]
    check(spec(*shape, mask="add", mask_dtype="bfloat16",
               mask_strides=(H * Sq * Sk, Sq * Sk, Sk, 1), causal=Sq == 37), form=True)


def test_long_keys_block_scope_and_tuning():
    """K^T / V of a head past the whole-head packing size: packed per key block; larger
    query and key blocks."""
    s = spec(1, 1, 40, 2100, 64)
    assert attention_plan(s, AMX).scope == "block"
    check(s, seed=7)
    check(spec(1, 2, 100, 300, 64, dtypes=F32), seed=8,
          tuning={"dot": "amx", "MQ": 64, "KB": 128})
    with pytest.raises(ValueError, match="multiple"):
        attention_plan(spec(1, 1, 64, 64, 64), {"dot": "amx", "MQ": 48})
