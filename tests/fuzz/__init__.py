"""Differential fuzzing of cannc against onnxruntime on random valid ONNX graphs.

- `gen.py`: the seeded generator (`random_model(seed, n_nodes=None, only=None)`): float32
  graphs with integer chains, float16 chains and bool values;
- `hypo.py`: its hypothesis front end (`graphs()`: the same op table, choices drawn by
  hypothesis, so a failing graph shrinks); `test_hypothesis.py` runs a short budget
  (`CANNC_FUZZ_HYPOTHESIS_EXAMPLES=500 CANNC_FUZZ_HYPOTHESIS_RANDOM=1` for a long one);
- `run.py`: `check(case)`, `campaign(seeds, out_dir)`, reproducers
  (`save_reproducer` / `load_reproducer`) and `shrink` (drop outputs while it fails);
- `test_fuzz.py`: the short budget of the test suite; `test_regressions.py`: one small
  explicit model per class of failure the fuzzer found;
- `python -m tests.fuzz --minutes 30 [--seed N] [--out DIR] [--only Op,Op] [--repro DIR]`:
  the long campaign.
"""
