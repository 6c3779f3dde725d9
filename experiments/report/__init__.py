"""The reproduction report: every claim of the papers next to what this suite measured and modelled.

``python -m experiments.report`` (``make report``) reads the papers' values (``experiments/paper/``),
whatever result folders exist and the figures drawn from them, and writes one static page,
``reports/index.html`` with its Markdown twin ``reports/index.md``. It measures nothing.
"""
