"""Plotting without a screen."""

from __future__ import annotations


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only), imported when a plot is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
