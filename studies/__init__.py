"""The papers' studies, apart from the runtime package: the paper's Table 1 (``ablation/``), its
control laws one at a time (``laws/``), the robustness of its signal (``stress/``) and the
related papers' systems (``seed_systems/``). They drive the engine through its public API and
``etinfer.bench.common``, and each run writes one JSON result in the engine benchmarks' schema
(``etinfer/bench/common/results.py``). Run them from a checkout: ``python -m studies NAME ...``
(``python -m studies --help`` lists them)."""

# How a study's command line starts, as its result records it.
PROGRAM = "python -m studies"
