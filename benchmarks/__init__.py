"""The results page: BENCHMARKS.md built from the kept results (``results/``), the page's prose
(``page/``) and its table definitions (``tables/``); ``python benchmarks/render.py``."""
