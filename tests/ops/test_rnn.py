"""RNN, GRU, LSTM (ops/rnn.py): cannc against onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import check_op

R = np.random.default_rng(11)


def f32(*shape):
    return (R.standard_normal(shape) * 0.5).astype(np.float32)


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_recurrent(op, direction):
    S, B, I, H = 5, 3, 7, 6
    G = {"RNN": 1, "GRU": 3, "LSTM": 4}[op]
    D = 2 if direction == "bidirectional" else 1
    ins = [f32(S, B, I), f32(D, G * H, I), f32(D, G * H, H), f32(D, 2 * G * H),
           np.array([5, 3, 4], np.int32), f32(D, B, H)]
    if op == "LSTM":
        ins += [f32(D, B, H), f32(D, 3 * H)]
    n_out = 3 if op == "LSTM" else 2
    check_op(op, ins, n_outputs=n_out, hidden_size=H, direction=direction, opset=14)


def test_gru_linear_before_reset():
    S, B, I, H = 4, 2, 5, 3
    ins = [f32(S, B, I), f32(1, 3 * H, I), f32(1, 3 * H, H), f32(1, 6 * H)]
    check_op("GRU", ins, n_outputs=2, hidden_size=H, linear_before_reset=1, opset=14)


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_batchwise_layout(op):
    """layout=1 (onnxruntime has no kernel for it): against onnx.reference."""
    from helpers import single_node_model
    from onnx.reference import ReferenceEvaluator

    import cannc
    S, B, I, H = 4, 3, 5, 6
    G = {"RNN": 1, "GRU": 3, "LSTM": 4}[op]
    ins = [f32(B, S, I), f32(1, G * H, I), f32(1, G * H, H), f32(1, 2 * G * H)]
    n_out = 3 if op == "LSTM" else 2
    m, feeds = single_node_model(op, ins, n_out, 14, hidden_size=H, layout=1)
    exp = ReferenceEvaluator(m).run(None, feeds)
    got = cannc.compile(m).run(None, feeds)
    for g, e in zip(got, exp):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def test_lstm_defaults_clip():
    S, B, I, H = 6, 2, 4, 5
    check_op("LSTM", [f32(S, B, I), f32(1, 4 * H, I), f32(1, 4 * H, H)], n_outputs=3,
             hidden_size=H, clip=0.7, opset=14)
