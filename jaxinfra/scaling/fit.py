"""Scaling-law fits: Chinchilla approaches 2 and 3, and a loss-vs-compute power law.

All three follow Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models"
(arXiv:2203.15556):

* `fit_parametric` -- approach 3 (section 3.3, appendix D.2): L(N, D) = E + A/N^alpha + B/D^beta,
  fitted in log space with the log-sum-exp parametrisation
  log L^ = LSE(a - alpha log N, b - beta log D, e), A = e^a, B = e^b, E = e^e,
  minimising the Huber loss (delta = 1e-3) of log L^ - log L with L-BFGS (scipy's L-BFGS-B)
  started from every point of the paper's initialisation grid; the best local optimum wins.
  Confidence intervals come from a bootstrap over the data points (as in Besiroglu et al.
  2024, "Chinchilla Scaling: A replication attempt", which also showed that the optimiser
  must be run to convergence -- hence the tight tolerances below).
  Compute-optimal allocation under C = 6 N D (the paper's convention; eq. 4):
      N_opt = G (C/6)^(beta/(alpha+beta)),  D_opt = G^-1 (C/6)^(alpha/(alpha+beta)),
      G = (alpha A / (beta B))^(1/(alpha+beta)).
* `fit_isoflop` -- approach 2 (section 3.2): for each compute budget, a parabola of loss
  against log N (and against log D) through the IsoFLOP profile; its minimum is that
  budget's N_opt (D_opt); then least squares of log N_opt = a log C + log k_N and
  log D_opt = b log C + log k_D. Here C is the table's own C column (for sweeps:
  flops_per_token x D from jaxinfra.metrics.flops), so predictions use the same accounting.
* `fit_frontier` -- the compute-efficient frontier (the Pareto set: no other run reaches a
  lower loss with no more compute) fitted by L(C) = k C^-gamma in log-log space (the simple
  form of Kaplan et al. 2020, eq. 1.4).

`fit_all` runs every approach the data allow and returns one JSON-able dict;
`predict` answers "what N, D and loss for compute C" from that dict.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import optimize, stats

HUBER_DELTA = 1e-3
# Hoffmann et al. 2022, appendix D.2: the initialisation grid of approach 3.
INIT_GRID = {
    "alpha": (0.0, 0.5, 1.0, 1.5, 2.0),
    "beta": (0.0, 0.5, 1.0, 1.5, 2.0),
    "e": (-1.0, -0.5, 0.0, 0.5, 1.0),
    "a": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
    "b": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
}
PARAM_NAMES = ("E", "A", "B", "alpha", "beta")
# theta = (a, b, e, alpha, beta)
_LBFGS_OPTIONS = {"maxiter": 2000, "ftol": 1e-13, "gtol": 1e-9}


# ---------------------------------------------------------------- approach 3


def init_grid() -> np.ndarray:
    """The initialisation grid as rows of theta = (a, b, e, alpha, beta): 4500 starts."""
    g = INIT_GRID
    return np.array([(a, b, e, al, be) for al, be, e, a, b in
                     itertools.product(g["alpha"], g["beta"], g["e"], g["a"], g["b"])], dtype=np.float64)


def _huber(r: np.ndarray, delta: float) -> tuple[np.ndarray, np.ndarray]:
    """Huber loss and its derivative, both divided by delta^2 (same minimiser; keeps the
    objective O(1) per point so L-BFGS-B's relative tolerances mean something)."""
    ar = np.abs(r)
    quad = ar <= delta
    h = np.where(quad, 0.5 * r * r, delta * (ar - 0.5 * delta)) / delta**2
    dh = np.where(quad, r, delta * np.sign(r)) / delta**2
    return h, dh


def huber_objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray,
                    delta: float = HUBER_DELTA) -> tuple[float, np.ndarray]:
    """Sum of Huber(log L^ - log L) over the points (scaled by 1/delta^2) and its gradient."""
    a, b, e, alpha, beta = theta
    z = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])
    zmax = z.max(axis=0)
    w = np.exp(z - zmax)
    s = w.sum(axis=0)
    lse = zmax + np.log(s)
    w /= s  # softmax: d lse / d z
    h, dh = _huber(lse - log_l, delta)
    grad = np.array([
        np.sum(dh * w[0]), np.sum(dh * w[1]), np.sum(dh * w[2]),
        -np.sum(dh * w[0] * log_n), -np.sum(dh * w[1] * log_d)])
    return float(h.sum()), grad


def _grid_objective(thetas: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray,
                    delta: float) -> np.ndarray:
    """The objective at many thetas at once (no gradient), [len(thetas)]."""
    a, b, e, alpha, beta = (thetas[:, i:i + 1] for i in range(5))
    z = np.stack([a - alpha * log_n, b - beta * log_d, np.broadcast_to(e, (len(thetas), len(log_n)))])
    lse = np.logaddexp(np.logaddexp(z[0], z[1]), z[2])
    return _huber(lse - log_l, delta)[0].sum(axis=1)


def screened_starts(grid: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray,
                    delta: float = HUBER_DELTA, top: int = 16) -> np.ndarray:
    """A diverse subset of the grid: for every (alpha, beta) pair the (a, b, e) point with the
    lowest objective, plus the `top` best points overall (about 40 of the 4500 starts).

    Running L-BFGS-B from all 4500 points costs ~2 minutes for 64 runs and lands on the
    same optimum (tests/test_scaling.py checks this on synthetic data); `starts="full"` does it.
    """
    obj = _grid_objective(grid, log_n, log_d, log_l, delta)
    keep = set(np.argsort(obj)[:top].tolist())
    pairs = {}
    for i, (al, be) in enumerate(map(tuple, grid[:, 3:5])):
        if (al, be) not in pairs or obj[i] < obj[pairs[(al, be)]]:
            pairs[(al, be)] = i
    keep.update(pairs.values())
    return grid[sorted(keep)]


def _minimise(theta0: np.ndarray, args: tuple) -> optimize.OptimizeResult:
    return optimize.minimize(huber_objective, theta0, args=args, jac=True, method="L-BFGS-B",
                             options=_LBFGS_OPTIONS)


def _one_blas_thread() -> contextlib.AbstractContextManager:
    """L-BFGS-B on 5 parameters gains nothing from BLAS threads, and on a busy machine their
    spin-waits made each fit 5-10x slower; limit them with threadpoolctl when it is installed."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


def _best_fit(starts: np.ndarray, args: tuple) -> tuple[np.ndarray, float]:
    best_x, best_f = None, math.inf
    for theta0 in starts:
        res = _minimise(theta0, args)
        if np.all(np.isfinite(res.x)) and res.fun < best_f:
            best_x, best_f = res.x, float(res.fun)
    if best_x is None:
        raise FloatingPointError("approach 3: no start of L-BFGS-B reached a finite optimum")
    return best_x, best_f


@dataclasses.dataclass(frozen=True)
class ParametricFit:
    """L(N, D) = E + A / N^alpha + B / D^beta (approach 3) with bootstrap intervals."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    ci: dict[str, tuple[float, float]]  # parameter -> (2.5%, 97.5%) bootstrap percentiles
    n_points: int
    n_bootstrap: int
    objective: float  # the minimised Huber sum (divided by delta^2)
    huber_delta: float = HUBER_DELTA

    def loss(self, n: Any, d: Any) -> np.ndarray:
        n, d = np.asarray(n, np.float64), np.asarray(d, np.float64)
        return self.E + self.A / n**self.alpha + self.B / d**self.beta

    def optimal(self, compute: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(N_opt, D_opt, L_opt) at compute C, allocating with C = 6 N D (Hoffmann et al. 2022, eq. 4)."""
        return optimal_allocation(self.E, self.A, self.B, self.alpha, self.beta, compute)

    def to_dict(self) -> dict[str, Any]:
        return {"E": self.E, "A": self.A, "B": self.B, "alpha": self.alpha, "beta": self.beta,
                "a": self.beta / (self.alpha + self.beta), "b": self.alpha / (self.alpha + self.beta),
                "ci": {k: list(v) for k, v in self.ci.items()}, "n_points": self.n_points,
                "n_bootstrap": self.n_bootstrap, "objective": self.objective, "huber_delta": self.huber_delta,
                "compute_rule": "C = 6 N D"}


def optimal_allocation(E: float, A: float, B: float, alpha: float, beta: float,
                       compute: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Closed-form minimiser of E + A/N^alpha + B/D^beta subject to 6 N D = C."""
    c = np.asarray(compute, np.float64) / 6.0
    g = (alpha * A / (beta * B)) ** (1.0 / (alpha + beta))
    n_opt = g * c ** (beta / (alpha + beta))
    d_opt = c ** (alpha / (alpha + beta)) / g
    return n_opt, d_opt, E + A / n_opt**alpha + B / d_opt**beta


def fit_parametric(n: Any, d: Any, loss: Any, *, bootstrap: int = 100, seed: int = 0,
                   delta: float = HUBER_DELTA, starts: str | np.ndarray = "screened",
                   bootstrap_starts: int = 3) -> ParametricFit:
    """Approach 3 of Hoffmann et al. 2022 (appendix D.2), see the module docstring.

    starts: "full" runs L-BFGS-B from every point of the paper's 4500-point grid;
    "screened" (default) from `screened_starts` of it; or an array of thetas
    (a, b, e, alpha, beta). The lowest optimum wins. Each bootstrap resample (rows drawn
    with replacement) restarts from the main optimum and from the `bootstrap_starts` grid
    points best on the full data; the intervals are the 2.5% and 97.5% percentiles.
    """
    n, d, loss = (np.asarray(x, np.float64).ravel() for x in (n, d, loss))
    if not (len(n) == len(d) == len(loss)):
        raise ValueError("N, D and loss must have the same length")
    if len(n) < len(PARAM_NAMES):
        raise ValueError(f"approach 3 needs at least {len(PARAM_NAMES)} runs for its 5 parameters, got {len(n)}")
    if np.any(n <= 0) or np.any(d <= 0) or np.any(loss <= 0):
        raise ValueError("N, D and loss must be positive")
    logs = (np.log(n), np.log(d), np.log(loss))
    grid = init_grid()
    if isinstance(starts, str):
        if starts not in ("screened", "full"):
            raise ValueError(f"starts must be 'screened', 'full' or an array of thetas, got {starts!r}")
        first = grid if starts == "full" else screened_starts(grid, *logs, delta)
    else:
        first = np.atleast_2d(np.asarray(starts, np.float64))
    with _one_blas_thread():
        theta, best = _best_fit(first, (*logs, delta))
        E, A, B, alpha, beta = _params(theta)
        rng = np.random.default_rng(seed)
        k = min(bootstrap_starts, len(grid))
        restarts = np.vstack([theta[None], grid[np.argsort(_grid_objective(grid, *logs, delta))[:k]]])
        samples = []
        for _ in range(bootstrap):
            idx = rng.integers(0, len(n), len(n))
            try:
                samples.append(_params(_best_fit(restarts, (logs[0][idx], logs[1][idx], logs[2][idx], delta))[0]))
            except FloatingPointError:
                continue
    ci = {}
    if samples:
        arr = np.array(samples)
        for i, name in enumerate(PARAM_NAMES):
            lo, hi = np.percentile(arr[:, i], [2.5, 97.5])
            ci[name] = (float(lo), float(hi))
    return ParametricFit(E=E, A=A, B=B, alpha=alpha, beta=beta, ci=ci, n_points=len(n),
                         n_bootstrap=len(samples), objective=best, huber_delta=delta)


def _params(theta: np.ndarray) -> tuple[float, float, float, float, float]:
    """theta -> (E, A, B, alpha, beta); FloatingPointError when a coefficient is beyond float range
    (a degenerate optimum: too few or too similar runs to pin the law down)."""
    a, b, e, alpha, beta = (float(x) for x in theta)
    try:
        return math.exp(e), math.exp(a), math.exp(b), alpha, beta
    except OverflowError:
        raise FloatingPointError(f"approach 3 diverged: log A={a:.3g}, log B={b:.3g}, log E={e:.3g}") from None


# ---------------------------------------------------------------- approach 2


@dataclasses.dataclass(frozen=True)
class Profile:
    """One IsoFLOP profile: its runs and the parabola minima in log N and log D."""

    compute: float  # geometric mean of the profile's C
    n: tuple[float, ...]
    d: tuple[float, ...]
    loss: tuple[float, ...]
    coef_n: tuple[float, float, float]  # loss = c0 (ln N)^2 + c1 ln N + c2
    coef_d: tuple[float, float, float]
    n_opt: float
    d_opt: float
    loss_opt: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class IsoflopFit:
    """N_opt = k_N C^a and D_opt = k_D C^b from the profiles' minima (approach 2)."""

    a: float
    k_n: float
    b: float
    k_d: float
    a_ci: tuple[float, float] | None  # 95% interval of the regression slope (>= 3 profiles)
    b_ci: tuple[float, float] | None
    profiles: tuple[Profile, ...]
    skipped: tuple[str, ...] = ()

    def optimal(self, compute: Any) -> tuple[np.ndarray, np.ndarray]:
        c = np.asarray(compute, np.float64)
        return self.k_n * c**self.a, self.k_d * c**self.b

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a, "k_N": self.k_n, "b": self.b, "k_D": self.k_d,
                "a_ci": list(self.a_ci) if self.a_ci else None, "b_ci": list(self.b_ci) if self.b_ci else None,
                "profiles": [p.to_dict() for p in self.profiles], "skipped": list(self.skipped),
                "compute_rule": "C as recorded in the table (flops_per_token x D for jaxinfra sweeps)"}


def group_budgets(compute: Any, budget: Any | None = None, rtol: float = 0.1) -> np.ndarray:
    """Profile index per point: equal `budget` values, or else C values within `rtol` of their
    neighbour (after sorting) share a profile."""
    c = np.asarray(compute, np.float64)
    if budget is not None:
        _, idx = np.unique(np.asarray(budget, np.float64), return_inverse=True)
        return idx
    order = np.argsort(c)
    idx = np.empty(len(c), np.int64)
    group = 0
    for j, i in enumerate(order):
        if j and math.log(c[i] / c[order[j - 1]]) > math.log1p(rtol):
            group += 1
        idx[i] = group
    return idx


def _parabola_min(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float, float] | None:
    coef = np.polyfit(x, y, 2)
    if coef[0] <= 0:
        return None
    x_min = -coef[1] / (2 * coef[0])
    return coef, float(x_min), float(np.polyval(coef, x_min))


def fit_isoflop(n: Any, d: Any, loss: Any, compute: Any, budget: Any | None = None) -> IsoflopFit:
    """Approach 2 of Hoffmann et al. 2022 (section 3.2), see the module docstring.

    Profiles with fewer than 3 distinct N, whose parabola opens downwards, or whose minimum
    lies outside the sampled N (an extrapolation the profile cannot support) are skipped and
    listed in `skipped`. At least 2 usable profiles are needed.
    """
    n, d, loss, c = (np.asarray(x, np.float64).ravel() for x in (n, d, loss, compute))
    groups = group_budgets(c, budget)
    profiles, skipped = [], []
    for g in np.unique(groups):
        m = groups == g
        cg = float(np.exp(np.mean(np.log(c[m]))))
        if len(np.unique(n[m])) < 3:
            skipped.append(f"C={cg:.3g}: {len(np.unique(n[m]))} model sizes (a parabola needs 3)")
            continue
        fn = _parabola_min(np.log(n[m]), loss[m])
        fd = _parabola_min(np.log(d[m]), loss[m])
        if fn is None or fd is None:
            skipped.append(f"C={cg:.3g}: the profile has no minimum (parabola opens downwards)")
            continue
        if not n[m].min() <= math.exp(fn[1]) <= n[m].max():
            side = "smaller" if math.exp(fn[1]) < n[m].min() else "larger"
            skipped.append(f"C={cg:.3g}: the loss keeps falling towards {side} N (minimum outside "
                           f"{n[m].min():.3g}..{n[m].max():.3g}); add {side} sizes")
            continue
        order = np.argsort(n[m])
        profiles.append(Profile(
            compute=cg, n=tuple(n[m][order]), d=tuple(d[m][order]), loss=tuple(loss[m][order]),
            coef_n=tuple(float(v) for v in fn[0]), coef_d=tuple(float(v) for v in fd[0]),
            n_opt=math.exp(fn[1]), d_opt=math.exp(fd[1]), loss_opt=fn[2]))
    if len(profiles) < 2:
        raise ValueError(f"{len(skipped)} of {len(skipped) + len(profiles)} compute budgets unusable; at least "
                         f"2 IsoFLOP profiles with 3+ model sizes each are needed"
                         + (f" ({first_few(skipped)})" if skipped else ""))
    log_c = np.log([p.compute for p in profiles])
    a, log_kn, a_ci = _line_fit(log_c, np.log([p.n_opt for p in profiles]))
    b, log_kd, b_ci = _line_fit(log_c, np.log([p.d_opt for p in profiles]))
    return IsoflopFit(a=a, k_n=math.exp(log_kn), b=b, k_d=math.exp(log_kd), a_ci=a_ci, b_ci=b_ci,
                      profiles=tuple(profiles), skipped=tuple(skipped))


def first_few(reasons: Sequence[str], limit: int = 3) -> str:
    """`a; b; c; and 4 more`: a note stays one readable line however many budgets a sweep has."""
    more = f"; and {len(reasons) - limit} more" if len(reasons) > limit else ""
    return "; ".join(reasons[:limit]) + more


def _line_fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float, tuple[float, float] | None]:
    """Least-squares slope and intercept, and a 95% t-interval of the slope (needs 3+ points)."""
    slope, intercept = np.polyfit(x, y, 1)
    ci = None
    if len(x) >= 3:
        resid = y - (slope * x + intercept)
        dof = len(x) - 2
        se = math.sqrt(float(resid @ resid) / dof / float(np.sum((x - x.mean()) ** 2)))
        half = float(stats.t.ppf(0.975, dof)) * se
        ci = (float(slope - half), float(slope + half))
    return float(slope), float(intercept), ci


# ---------------------------------------------------------------- the frontier


@dataclasses.dataclass(frozen=True)
class FrontierFit:
    """L(C) = k C^-gamma through the compute-efficient frontier."""

    k: float
    gamma: float
    gamma_ci: tuple[float, float] | None
    points: tuple[tuple[float, float], ...]  # (C, loss) on the frontier

    def loss(self, compute: Any) -> np.ndarray:
        return self.k * np.asarray(compute, np.float64) ** -self.gamma

    def to_dict(self) -> dict[str, Any]:
        return {"k": self.k, "gamma": self.gamma, "gamma_ci": list(self.gamma_ci) if self.gamma_ci else None,
                "points": [list(p) for p in self.points]}


def pareto_frontier(compute: Any, loss: Any) -> np.ndarray:
    """Indices of the runs no other run beats (lower loss with no more compute), by C."""
    c, y = np.asarray(compute, np.float64), np.asarray(loss, np.float64)
    keep, best = [], math.inf
    for i in np.lexsort((y, c)):
        if y[i] < best:
            keep.append(i)
            best = y[i]
    return np.array(keep, np.int64)


def fit_frontier(compute: Any, loss: Any) -> FrontierFit:
    """Log-log least squares of loss on compute over the Pareto frontier (2+ points)."""
    c, y = np.asarray(compute, np.float64), np.asarray(loss, np.float64)
    idx = pareto_frontier(c, y)
    if len(np.unique(c[idx])) < 2:
        raise ValueError("the frontier fit needs at least 2 frontier runs with different compute")
    slope, intercept, ci = _line_fit(np.log(c[idx]), np.log(y[idx]))
    return FrontierFit(k=math.exp(intercept), gamma=-slope, gamma_ci=(-ci[1], -ci[0]) if ci else None,
                       points=tuple((float(c[i]), float(y[i])) for i in idx))


# ---------------------------------------------------------------- everything at once


def fit_all(table: dict[str, np.ndarray], *, bootstrap: int = 100, seed: int = 0,
            n_column: str = "N", target: str = "eval_loss") -> dict[str, Any]:
    """Every approach the table allows: {"approach3", "approach2", "frontier", "notes", ...}.

    `table` maps column names to arrays and needs `n_column` (default N), `D` and
    `target` (the quantity fitted as the loss: eval_loss, or e.g. a task's error); `C` defaults to
    6 N D; `C_budget` (the IsoFLOP profile label) defaults to
    grouping runs whose C agree within 10%.
    Approaches the data cannot support are left out with a line in "notes".
    """
    n, d, loss = table[n_column], table["D"], table[target]
    compute = table["C"] if "C" in table else 6.0 * n * d
    out: dict[str, Any] = {"n_column": n_column, "target": target, "n_points": int(len(n)), "notes": []}
    try:
        out["approach3"] = fit_parametric(n, d, loss, bootstrap=bootstrap, seed=seed).to_dict()
    except (ValueError, FloatingPointError) as e:
        out["notes"].append(f"approach 3 skipped: {e}")
    try:
        out["approach2"] = fit_isoflop(n, d, loss, compute, _labels(table.get("C_budget"))).to_dict()
    except ValueError as e:
        out["notes"].append(f"approach 2 skipped: {e}")
    try:
        out["frontier"] = fit_frontier(compute, loss).to_dict()
    except ValueError as e:
        out["notes"].append(f"frontier skipped: {e}")
    return out


def _labels(column: np.ndarray | None) -> np.ndarray | None:
    """A budget column usable as profile labels: numeric and complete, else None."""
    if column is None or column.dtype == object or not np.all(np.isfinite(column)):
        return None
    return column


def parametric_from_dict(fit: dict[str, Any]) -> ParametricFit:
    p = fit["approach3"]
    return ParametricFit(E=p["E"], A=p["A"], B=p["B"], alpha=p["alpha"], beta=p["beta"],
                         ci={k: tuple(v) for k, v in p.get("ci", {}).items()}, n_points=p.get("n_points", 0),
                         n_bootstrap=p.get("n_bootstrap", 0), objective=p.get("objective", math.nan),
                         huber_delta=p.get("huber_delta", HUBER_DELTA))


def predict(fit: dict[str, Any], compute: float) -> dict[str, Any]:
    """N_opt, D_opt and loss at compute C from a saved `fit_all` result, per approach.

    approach3 allocates with C = 6 N D (Hoffmann et al. 2022); approach2 uses the power laws
    fitted on the table's own C (flops_per_token x D for jaxinfra sweeps); frontier gives L(C).
    """
    if not compute > 0:
        raise ValueError(f"compute must be positive, got {compute}")
    out: dict[str, Any] = {"compute": float(compute)}
    if "approach3" in fit:
        n_opt, d_opt, l_opt = parametric_from_dict(fit).optimal(compute)
        out["approach3"] = {"N_opt": float(n_opt), "D_opt": float(d_opt), "loss": float(l_opt),
                            "tokens_per_param": float(d_opt / n_opt), "compute_rule": "C = 6 N D"}
    if "approach2" in fit:
        p = fit["approach2"]
        n_opt, d_opt = p["k_N"] * compute ** p["a"], p["k_D"] * compute ** p["b"]
        out["approach2"] = {"N_opt": n_opt, "D_opt": d_opt, "tokens_per_param": d_opt / n_opt,
                            "compute_rule": "C as in the fitted table"}
    if "frontier" in fit:
        f = fit["frontier"]
        out["frontier"] = {"loss": f["k"] * compute ** -f["gamma"]}
    if len(out) == 1:
        raise ValueError("the fit holds no approach to predict from")
    return out
