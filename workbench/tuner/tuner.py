"""``workbench.tune(model)``: the plan tuner widget.

Every plan field is a control, the pipeline's too (stages, schedule, chunks per rank,
micro-batches). Each change re-validates the plan and re-predicts its memory per tier and step
time (plain arithmetic, instant; under pp with the schedule's bubble and the largest stage's
memory); an impossible plan shows ``Plan.validate``'s message instead. "Measure" runs a few
real steps of the plan on the pool (a pp plan trains through its pipeline schedule) and adds
measured beside predicted to the trials table; "Use this plan" makes it the default of later
``%%colossal`` cells; "Recommend" moves the controls to ``workbench.recommend``'s choice.

Controls are grouped by dimension (``controls.GROUPS``), each with its full label and a
tooltip. Beside the prediction's table the plan is drawn (``panes``, ``figures``): memory per
tier per rank against the budgets, and the step time's split; after "Recommend" every
candidate plan as a point of step time against peak memory, the Pareto front joined, where a
click selects a plan (``select``: the controls move to it); after a trial, predicted against
measured. The figures are drawn once the tuner is shown (``panes``).

Buttons act only when the kernel is idle (browser-to-kernel widget events wait for it), so a
measurement never races a running cell. Every action reports in the message line and never
raises into the widget machinery, where an exception would vanish into the browser console.
The same actions are methods (``set``, ``select``, ``measure``, ``use``, ``recommend``) for
scripts.
"""

from __future__ import annotations

import html
from dataclasses import replace
from typing import Any

import ipywidgets as widgets

from kernels_runtime.mesh.plan import Plan, PlanError
from workbench.errors import PoolError, RankFailureError
from workbench.planner import PROFILES, HardwareProfile, ModelSpec, calibrate, predict
from workbench.planner import recommend as recommend_plans
from workbench.planner.cost_model import Prediction, plan_label
from workbench.planner.recommend import per_step_workload
from workbench.tuner import render
from workbench.tuner.breakdown import budgets
from workbench.tuner.controls import (
    LABEL_STYLE,
    grouped,
    make_controls,
    plan_from,
    read,
    set_value,
)
from workbench.tuner.panes import TunerFigures
from workbench.tuner.trials import Trial
from workbench.tuner.trials import measure as measure_trial

POOL_HARDWARE = "this pool (calibrated)"


class Tuner:
    """The tuner's state and widget; ``workbench.tune(...)`` builds and shows one."""

    def __init__(self, model: Any, *, pool: Any = None, world_size: int | None = None,
                 hardware: HardwareProfile | str | None = None,
                 memory_budget: float | None = None, plan: Plan | str | None = None,
                 steps: int = 3, warmup: int = 1, timeout_s: float = 300.0, shell: Any = None,
                 **workload: Any) -> None:
        from workbench.cells.session import active_magics, active_pool

        spec = ModelSpec.from_config(model, **workload)
        # Measure builds Hugging Face models, whose default attention is the fused one: predict
        # for that unless the config names another (attention="eager" for the textbook count)
        spec = spec if spec.attention else replace(spec, attention="sdpa")
        self._shell = shell
        self._given_pool = pool
        live = pool if pool is not None else active_pool(shell)
        live = live if live is not None and live.started else None
        self.world_size = world_size or (live.world_size if live else 8)
        # one workload for every plan: a per-rank batch is the global batch of dp = world, so
        # a tp or sp plan (fewer data-parallel ranks, more samples each) does the same work
        self.spec = per_step_workload(spec, self.world_size)
        self.memory_budget = memory_budget
        self.steps, self.warmup, self.timeout_s = steps, warmup, timeout_s
        self.trials: list[Trial] = []
        self.profiles: dict[str, HardwareProfile] = dict(PROFILES)
        if isinstance(hardware, HardwareProfile):
            self.profiles[hardware.name] = hardware
            hardware = hardware.name
        if hardware is None:
            hardware = POOL_HARDWARE if live else "H100"
        if hardware == POOL_HARDWARE and live is None:
            raise PoolError("hardware='pool' needs a running pool: `%colossal start` first, or "
                            f"pick one of {', '.join(PROFILES)}")
        if hardware not in self.profiles and hardware != POOL_HARDWARE:
            raise ValueError(f"hardware={hardware!r} is unknown; choose one of "
                             f"{', '.join(self.profiles)} or pass a HardwareProfile")
        magics = active_magics(shell)
        initial = Plan.parse(plan) if plan is not None else (
            magics.default_plan if magics is not None else Plan())
        self.controls = make_controls(self.world_size, initial)
        hw_options = ([POOL_HARDWARE] if live else []) + list(self.profiles)
        self.hardware_control = widgets.Dropdown(options=hw_options, value=hardware,
                                                 description="predict on",
                                                 tooltip="hardware the prediction is for",
                                                 style=LABEL_STYLE,
                                                 layout=widgets.Layout(width="auto"))
        self.figures = TunerFigures(on_pick=lambda plan: self._guarded(
            lambda: self.select(plan)))
        self.prediction_pane = widgets.HTML()
        self.message_pane = widgets.HTML()
        self.trials_pane = widgets.HTML(render.trials_html(self.trials))
        self.measure_button = widgets.Button(description="Measure", icon="play",
                                             tooltip="run a few real steps on the pool")
        self.use_button = widgets.Button(description="Use this plan", icon="check",
                                         tooltip="default plan of later %%colossal cells")
        self.recommend_button = widgets.Button(description="Recommend", icon="magic",
                                               tooltip="move the controls to the best plan")
        self.measure_button.on_click(lambda _: self._guarded(self.measure))
        self.use_button.on_click(lambda _: self._guarded(self.use))
        self.recommend_button.on_click(lambda _: self._guarded(self.recommend))
        self._moving = False  # ``set`` is moving several controls: predict once, after
        for control in (*self.controls.values(), self.hardware_control):
            control.observe(self._control_moved, names="value")
        self.plan: Plan | None = None
        self.error: str | None = None
        self.prediction: Prediction | None = None
        self.message = ""
        self.widget = self._layout()
        self._guarded(self.update)

    # ---- state --------------------------------------------------------------------------
    @property
    def pool(self) -> Any:
        """The pool trials run on: the one given, else the notebook's running pool."""
        from workbench.cells.session import active_pool

        pool = self._given_pool if self._given_pool is not None else active_pool(self._shell)
        return pool if pool is not None and pool.started else None

    @property
    def values(self) -> dict[str, Any]:
        return {name: read(control) for name, control in self.controls.items()}

    @property
    def hardware(self) -> HardwareProfile:
        name = self.hardware_control.value
        if name == POOL_HARDWARE and name not in self.profiles:
            pool = self.pool
            if pool is None:
                raise PoolError("the pool is gone: pick another hardware profile or start one")
            dtypes = ("fp32", "bf16", "fp16") if pool.backend == "nccl" else ("fp32", "bf16")
            self._say(f"calibrating the pool's {pool.world_size} ranks…")
            self.profiles[POOL_HARDWARE] = calibrate(pool, self.spec, dtypes)
        return self.profiles[name]

    def set(self, plan: Plan | str | None = None, **fields: Any) -> Tuner:
        """Move the controls: to ``plan``'s values, then to ``fields`` (``zero_stage=2``)."""
        values = Plan.parse(plan).as_dict() if plan is not None else {}
        values.update(fields)
        unknown = sorted(set(values) - set(self.controls))
        if unknown:
            raise ValueError(f"not plan fields: {', '.join(unknown)}; fields are "
                             f"{', '.join(self.controls)}")
        self._moving = True
        try:
            with self.widget.hold_sync():
                for name, value in values.items():
                    set_value(self.controls[name], value)
        finally:
            self._moving = False
        self.update()
        return self

    def _control_moved(self, _change: Any) -> None:
        """A control moved (in the browser, or by a script): predict the plan it makes."""
        if not self._moving:  # a half-moved plan is not shown (nor its figures drawn)
            self._guarded(self.update)

    def update(self) -> None:
        """Validate and predict the controls' plan, and show the result."""
        self.plan, self.error, self.prediction = None, None, None
        try:
            plan = plan_from(self.values)
            self.prediction = predict(plan, self.spec, self.hardware, world_size=self.world_size)
            self.plan = self.prediction.plan
        except (PlanError, ValueError) as e:
            self.error = str(e)
        if self.error is not None:
            self.prediction_pane.value = render.error_html(self.error)
        else:
            self.prediction_pane.value = render.prediction_html(
                self.prediction, self.hardware_control.value, self.memory_budget)
        self.figures.show_prediction(
            self.prediction, budgets(self.prediction, self.memory_budget)
            if self.prediction is not None else {})
        self.figures.mark_selected(self.plan)
        for button in (self.measure_button, self.use_button):
            button.button_style = "" if self.error else "primary"

    def select(self, plan: Plan | str) -> Tuner:
        """Move every control to ``plan`` (what clicking a candidate point does)."""
        self.set(Plan.parse(plan))
        if self.plan is not None:
            self._say(f"selected <code>{html.escape(plan_label(self.plan))}</code>: "
                      f"{render.seconds(self.prediction.step_time)} per step, peak "
                      f"{render.size(self.prediction.peak_bytes)} per rank", escape=False)
        return self

    # ---- actions ------------------------------------------------------------------------
    def measure(self) -> Trial | None:
        """Run the current plan on the pool; None (and a message) when it cannot run."""
        if self.prediction is None:
            self._say(f"Not measured: the plan is invalid. {self.error}", error=True)
            return None
        pool = self.pool
        if pool is None:
            self._say("Not measured: no pool is running. Start one with `%colossal start -n "
                      f"{self.world_size}`, then press Measure again.", error=True)
            return None
        if pool.world_size != self.world_size:
            self._say(f"Not measured: the pool has {pool.world_size} ranks and this tuner plans "
                      f"for {self.world_size}; call workbench.tune(..., world_size="
                      f"{pool.world_size}) or restart the pool with {self.world_size} ranks.",
                      error=True)
            return None
        label = plan_label(self.prediction.plan)
        self._say(f"measuring <code>{html.escape(label)}</code>: {self.steps} steps on "
                  f"{pool.world_size} ranks…", escape=False)
        try:
            trial = measure_trial(pool, self.prediction, self.hardware_control.value,
                                  steps=self.steps, warmup=self.warmup, timeout_s=self.timeout_s)
        except (RankFailureError, PoolError) as e:
            trial = Trial(label, self.hardware_control.value, self.prediction.step_time,
                          self.prediction.measurable_bytes, error=_first_line(e))
        self.trials.append(trial)
        self.trials_pane.value = render.trials_html(self.trials)
        self.figures.show_trials(self.trials)
        if trial.ok:
            self._say(f"measured {render.seconds(trial.measured_step_s)} per step "
                      f"(predicted {render.seconds(trial.predicted_step_s)}, "
                      f"{render.percent(trial.time_error())})")
        else:
            self._say(f"The trial failed: {trial.error}", error=True)
        return trial

    def use(self) -> Plan | None:
        """Make the current plan the default of later ``%%colossal`` cells."""
        if self.plan is None:
            self._say(f"Not used: the plan is invalid. {self.error}", error=True)
            return None
        magics = _magics(self._shell)
        chosen = plan_from(self.values)  # as written: dp=auto stays auto for other pool sizes
        magics.default_plan = chosen
        self._say(f"Later %%colossal cells without --plan run under "
                  f"<code>{html.escape(chosen.to_string())}</code>.", escape=False)
        return chosen

    def recommend(self) -> Any:
        """Move the controls to the fastest plan that fits the memory budget."""
        hw = self.hardware
        rec = recommend_plans(self.spec, self.world_size, self.memory_budget, hw,
                              precisions=tuple(p for p in ("fp32", "bf16", "fp16")
                                               if hw.supports(p)))
        self.figures.show_candidates([*rec.ranked, *rec.over_budget], rec.budget, rec.plan)
        self.set(rec.plan)
        self._say(f"<pre style='margin:0'>{html.escape(rec.explain(3))}</pre>", escape=False)
        return rec

    # ---- display ------------------------------------------------------------------------
    def _layout(self) -> widgets.Widget:
        title = widgets.HTML(f"<b>Plan tuner</b>: {html.escape(self.spec.describe())}, "
                             f"{self.world_size} ranks")
        groups = grouped(self.controls, {"prediction": [self.hardware_control]})
        buttons = widgets.HBox([self.measure_button, self.use_button, self.recommend_button])
        return widgets.VBox([title, groups, self.prediction_pane, self.figures.prediction_box,
                             buttons, self.message_pane, self.figures.candidates_box,
                             widgets.HTML("<b>Trials</b>"), self.trials_pane,
                             self.figures.trials_box])

    def _say(self, text: str, error: bool = False, escape: bool = True) -> None:
        self.message = text
        body = html.escape(text) if escape else text
        color = "#b00020" if error else "inherit"
        self.message_pane.value = f"<div style='color:{color}'>{body}</div>"

    def _guarded(self, action: Any) -> None:
        """Run a widget action; show any error in the message line instead of losing it."""
        try:
            action()
        except Exception as e:  # noqa: BLE001 - shown to the user, nothing is swallowed silently
            self._say(f"{type(e).__name__}: {e}", error=True)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        self.figures.start()  # figures are drawn from the moment they can be seen
        display(self.widget)

    def __repr__(self) -> str:
        state = self.error or (self.prediction.summary() if self.prediction else "")
        return f"<Tuner {self.spec.describe()}, {self.world_size} ranks: {state}>"


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _magics(shell: Any) -> Any:
    """The notebook's ``ColossalMagics``, loading the extension if it is not loaded yet."""
    from IPython import get_ipython

    from workbench.cells.session import active_magics

    magics = active_magics(shell)
    if magics is None:
        ip = shell or get_ipython()
        if ip is None:
            raise RuntimeError("Use this plan needs an IPython kernel: it sets the default plan "
                               "of %%colossal cells")
        ip.run_line_magic("load_ext", "workbench")
        magics = active_magics(ip)
    return magics


def tune(model: Any, **options: Any) -> Tuner:
    """Show the plan tuner for ``model`` (a ModelSpec, dict or HF config; workload keywords
    such as ``seq=``, ``batch=`` or ``global_batch=`` fill what a model config lacks).

    A per-rank ``batch`` is the samples per rank under pure data parallelism: the tuner holds
    that global batch fixed for every plan, so a tp or sp plan gives each data-parallel replica
    more samples rather than doing less work.

    Options: ``pool`` (default: the notebook's running pool), ``world_size`` (default: the
    pool's, else 8), ``hardware`` (a profile or "A100"/"H100"/"H200"; default: the pool
    calibrated on first use, else "H100"), ``memory_budget`` (bytes per rank), ``plan``
    (initial plan; default: the current default plan), ``steps`` and ``warmup`` per trial.
    """
    return Tuner(model, **options)
