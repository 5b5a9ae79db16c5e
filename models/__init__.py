"""Test/benchmark models for cannc.

``models.zoo`` builds a small, reproducible zoo of ONNX models (MLP, ResNet,
MobileNetV2, BERT and GPT-2 style) from a seed with ``onnx.helper`` + numpy.
"""
