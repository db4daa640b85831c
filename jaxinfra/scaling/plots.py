"""PNG plots of a scaling fit (matplotlib, Agg backend; `pip install -e '.[scaling]'`).

* isoflop.png -- loss against N per compute budget with the fitted parabolas and their
  minima, and N_opt against C with the approach-2 power law (Hoffmann et al. 2022, fig. 3).
  Without IsoFLOP profiles in the data, the approach-3 law's own IsoFLOP curves are drawn.
* frontier.png -- every run's loss against its compute, the compute-efficient frontier
  and its L(C) power law, and the approach-3 compute-optimal loss L(N_opt(C), D_opt(C)).
* predicted_vs_observed.png -- approach-3 predictions against the observed losses.
"""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np

from jaxinfra.atomic import atomic_file
from jaxinfra.config import ConfigError
from jaxinfra.scaling.fit import optimal_allocation


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install -e '.[scaling]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plain_log_labels(axis: Any) -> None:
    """Label a log axis 2, 3, 4 rather than 2x10^0 (losses span less than a decade)."""
    from matplotlib.ticker import FuncFormatter

    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def _label(fit: dict[str, Any]) -> str:
    """The fitted quantity's axis label: the final eval loss, or the task metric (or its error) fitted."""
    target = fit.get("target", "eval_loss")
    return "final eval loss" if target == "eval_loss" else target


def plot_all(table: dict[str, np.ndarray], fit: dict[str, Any], out_dir: str | pathlib.Path) -> list[pathlib.Path]:
    """Writes the three PNGs (those the fit supports) into out_dir; returns their paths."""
    plt = _pyplot()
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n = table[fit.get("n_column", "N")]
    d, loss = table["D"], table[fit.get("target", "eval_loss")]
    compute = table["C"] if "C" in table else 6.0 * n * d
    paths = []
    for name, draw in (("isoflop.png", _isoflop), ("frontier.png", _frontier),
                       ("predicted_vs_observed.png", _predicted)):
        fig = draw(plt, n, d, loss, compute, fit)
        if fig is None:
            continue
        path = out_dir / name
        with atomic_file(path, "wb", replace=True) as f:  # redrawn by every fit
            fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


def _isoflop(plt: Any, n: np.ndarray, d: np.ndarray, loss: np.ndarray, compute: np.ndarray,
             fit: dict[str, Any]) -> Any:
    a2, a3 = fit.get("approach2"), fit.get("approach3")
    if a2 is None and a3 is None:
        return None
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    cmap = plt.get_cmap("viridis")
    if a2 is not None:
        profiles = a2["profiles"]
        for i, p in enumerate(profiles):
            color = cmap(i / max(len(profiles) - 1, 1))
            pn = np.array(p["n"])
            ax.scatter(pn, p["loss"], color=color, s=18, label=f"C={p['compute']:.2g}")
            x = np.linspace(np.log(pn.min()) - 0.2, np.log(pn.max()) + 0.2, 100)
            ax.plot(np.exp(x), np.polyval(p["coef_n"], x), color=color, lw=1)
            ax.scatter([p["n_opt"]], [p["loss_opt"]], color=color, marker="*", s=120, edgecolor="k", zorder=3)
        c = np.array([p["compute"] for p in profiles])
        ax2.scatter(c, [p["n_opt"] for p in profiles], color="k", s=20, label="profile minima")
        grid = np.geomspace(c.min() / 3, c.max() * 3, 50)
        ax2.plot(grid, a2["k_N"] * grid ** a2["a"], "k-", lw=1, label=f"approach 2: N_opt ∝ C^{a2['a']:.3f}")
        ax.set_title("IsoFLOP profiles (approach 2), ★ = parabola minima")
    else:  # curves of the approach-3 law at the data's compute budgets
        budgets = np.geomspace(compute.min(), compute.max(), 4)
        for i, cb in enumerate(budgets):
            color = cmap(i / 3)
            ns = np.geomspace(n.min() / 3, n.max() * 3, 100)
            ax.plot(ns, _law(a3, ns, cb / (6 * ns)), color=color, lw=1, label=f"C={cb:.2g}")
            n_opt, _, l_opt = optimal_allocation(a3["E"], a3["A"], a3["B"], a3["alpha"], a3["beta"], cb)
            ax.scatter([n_opt], [l_opt], color=color, marker="*", s=120, edgecolor="k", zorder=3)
        ax.scatter(n, loss, color="gray", s=12, label="runs")
        ax.set_title("IsoFLOP curves of the approach-3 law (C = 6ND)")
        c = compute
    if a3 is not None:
        grid = np.geomspace(c.min() / 3, c.max() * 3, 50)
        n_opt = optimal_allocation(a3["E"], a3["A"], a3["B"], a3["alpha"], a3["beta"], grid)[0]
        ax2.plot(grid, n_opt, "C3--", lw=1, label=f"approach 3: N_opt ∝ C^{a3['a']:.3f}")
    ax.set_xscale("log")
    ax.set_xlabel("parameters N")
    ax.set_ylabel(_label(fit))
    ax.legend(fontsize=7)
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    from matplotlib.ticker import NullFormatter

    ax2.xaxis.set_minor_formatter(NullFormatter())  # short ranges would print overlapping minor labels
    ax2.set_xlabel("compute C (FLOPs)")
    ax2.set_ylabel("compute-optimal N")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _law(p: dict[str, Any], n: Any, d: Any) -> np.ndarray:
    return p["E"] + p["A"] / np.asarray(n) ** p["alpha"] + p["B"] / np.asarray(d) ** p["beta"]


def _frontier(plt: Any, n: np.ndarray, d: np.ndarray, loss: np.ndarray, compute: np.ndarray,
              fit: dict[str, Any]) -> Any:
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    sc = ax.scatter(compute, loss, c=np.log10(n), cmap="viridis", s=20, label="runs")
    fig.colorbar(sc, ax=ax, label="log10 N")
    grid = np.geomspace(compute.min() / 2, compute.max() * 2, 100)
    fr = fit.get("frontier")
    if fr is not None:
        pts = np.array(fr["points"])
        ax.plot(pts[:, 0], pts[:, 1], "ko", mfc="none", ms=9, label="frontier runs")
        ax.plot(grid, fr["k"] * grid ** -fr["gamma"], "k-", lw=1,
                label=f"L(C) = {fr['k']:.3g} C^-{fr['gamma']:.3f}")
    a3 = fit.get("approach3")
    if a3 is not None:
        l_opt = optimal_allocation(a3["E"], a3["A"], a3["B"], a3["alpha"], a3["beta"], grid)[2]
        ax.plot(grid, l_opt, "C3--", lw=1, label="approach 3: L(N_opt, D_opt), C = 6ND")
    ax.set_xscale("log")
    ax.set_yscale("log")
    _plain_log_labels(ax.yaxis)
    ax.set_xlabel("compute C (FLOPs)")
    ax.set_ylabel(_label(fit))
    ax.set_title("compute-efficient frontier")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _predicted(plt: Any, n: np.ndarray, d: np.ndarray, loss: np.ndarray, compute: np.ndarray,
               fit: dict[str, Any]) -> Any:
    a3 = fit.get("approach3")
    if a3 is None:
        return None
    pred = _law(a3, n, d)
    fig, ax = plt.subplots(figsize=(5, 4.5))
    sc = ax.scatter(loss, pred, c=np.log10(n), cmap="viridis", s=20)
    fig.colorbar(sc, ax=ax, label="log10 N")
    lo, hi = min(loss.min(), pred.min()), max(loss.max(), pred.max())
    ax.plot([lo, hi], [lo, hi], "k--", lw=1)
    rel = np.abs(pred / loss - 1)
    ax.set_title(f"approach 3 fit: mean |error| {rel.mean():.2%}, max {rel.max():.2%}")
    ax.set_xlabel(f"observed {_label(fit)}")
    ax.set_ylabel("predicted E + A/N^α + B/D^β")
    fig.tight_layout()
    return fig
