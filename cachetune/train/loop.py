"""A resumable training loop for the trained reuse methods (C2KV's extractor first).

    cachetune c2kv train --out runs/c2kv --steps 400 --max-minutes 110

Everything a run needs to continue lives in `out/`: `checkpoint.safetensors` (the trainable tensors
and AdamW's moments, safetensors: nothing is unpickled), `state.json` (step, settings, the loss
history) and `weights.safetensors` (the latest trained tokens alone, what serving loads). Both files are
written atomically every `save_every` steps and when the run stops: a run killed at any moment
resumes from its last checkpoint, and because each step's data is a pure function of (seed, step)
it sees the same documents an uninterrupted run would. `max_minutes` ends a run cleanly so that a
piece run in a time-boxed job stops before the job is killed.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from cachetune.train.objective import KD_SPANS, LOSSES

CHECKPOINT = "checkpoint.safetensors"
STATE = "state.json"
WEIGHTS = "weights.safetensors"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 600             # optimizer steps in the whole run (sets the cosine schedule)
    accumulate: int = 4          # examples per optimizer step
    lr: float = 2e-4
    warmup: int = 30             # linear warm-up steps, then cosine down to lr * min_lr_ratio
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    clip: float = 1.0            # gradient norm clipping
    loss: str = "ce"             # "ce" (answer cross-entropy), "kd" (distil the full-context model), "ce+kd"
    kd_span: str = "answer"      # where "kd" distils: the answer positions or the whole "tail" (question too)
    ce_weight: float = 1.0       # weight of the answer cross-entropy in "ce+kd" (the KL's is 1)
    seed: int = 0                # data draws are a function of (seed, step)
    eval_every: int = 50         # held-out loss every N steps (and at the end)
    eval_examples: int = 24      # held-out examples the progress loss averages over
    save_every: int = 10
    max_minutes: float | None = None  # stop cleanly (checkpointed) after this much wall time
    init: str | None = None      # start from these trained weights (e.g. another loss's run), not step 0

    def __post_init__(self) -> None:
        for name in ("steps", "accumulate", "eval_every", "eval_examples", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not (self.lr > 0 and 0 <= self.min_lr_ratio <= 1 and self.clip > 0 and self.warmup >= 0):
            raise ValueError("need lr > 0, 0 <= min_lr_ratio <= 1, clip > 0, warmup >= 0")
        if not self.ce_weight > 0:
            raise ValueError(f"ce_weight must be > 0, got {self.ce_weight}")
        if self.loss not in LOSSES or self.kd_span not in KD_SPANS:
            raise ValueError(f"loss must be one of {LOSSES} and kd_span one of {KD_SPANS}")


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to cfg.lr over `warmup` steps, then cosine decay to lr * min_lr_ratio at `steps`."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class Trainer:
    """AdamW over `params` (name -> tensor) with the schedule, clipping and checkpoints of `cfg`.

    loss_fn(step, index) -> scalar loss of the `index`-th example of `step`; heldout_fn() -> mean
    held-out loss (no grad); save_weights(path) writes the servable weights (called with the
    checkpoint). `identity` names the run (model, method, variant): resuming another run's folder is
    an error, not a silent mix."""

    def __init__(self, out: str | Path, cfg: TrainConfig, params: dict[str, torch.nn.Parameter],
                 loss_fn: Callable[[int, int], torch.Tensor], heldout_fn: Callable[[], float],
                 save_weights: Callable[[Path, dict], None], identity: dict):
        self.out, self.cfg, self.params = Path(out), cfg, params
        self.loss_fn, self.heldout_fn, self.save_weights = loss_fn, heldout_fn, save_weights
        self.identity = identity
        self.optimizer = torch.optim.AdamW(list(params.values()), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.step = 0
        self.history: list[dict] = []
        self.elapsed_s = 0.0

    # ---- checkpoints --------------------------------------------------------------------------
    def resume(self) -> bool:
        """Load `out/`'s checkpoint if there is one; True when resumed."""
        state_path = self.out / STATE
        if not state_path.exists():
            return False
        state = json.loads(state_path.read_text())
        if state.get("identity") != self.identity:
            raise ValueError(f"{self.out} holds another run ({state.get('identity')}); use another --out")
        if state.get("config", {}).get("steps") != self.cfg.steps:
            raise ValueError(f"{self.out}: the run was planned for {state['config']['steps']} steps "
                             f"(the schedule depends on it); pass --steps {state['config']['steps']}")
        tensors = load_file(str(self.out / CHECKPOINT))
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(tensors[f"param/{name}"])
        for name, p in self.params.items():
            key = f"adam/{name}/exp_avg"
            if key in tensors:
                self.optimizer.state[p] = {"step": torch.tensor(float(state["step"])),
                                           "exp_avg": tensors[key].clone(),
                                           "exp_avg_sq": tensors[f"adam/{name}/exp_avg_sq"].clone()}
        self.step, self.history, self.elapsed_s = state["step"], state["history"], state.get("elapsed_s", 0.0)
        return True

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        tensors = {f"param/{n}": p.detach().cpu().contiguous() for n, p in self.params.items()}
        for n, p in self.params.items():
            st = self.optimizer.state.get(p)
            if st:
                tensors[f"adam/{n}/exp_avg"] = st["exp_avg"].cpu().contiguous()
                tensors[f"adam/{n}/exp_avg_sq"] = st["exp_avg_sq"].cpu().contiguous()
        _atomic(self.out / CHECKPOINT, lambda tmp: save_file(tensors, str(tmp)))
        meta = {"step": self.step, "elapsed_s": round(self.elapsed_s, 1)}
        self.save_weights(self.out / WEIGHTS, meta)
        state = {"identity": self.identity, "config": asdict(self.cfg), "step": self.step,
                 "elapsed_s": self.elapsed_s, "history": self.history}
        _atomic(self.out / STATE, lambda tmp: tmp.write_text(json.dumps(state, indent=1)))

    # ---- the loop -----------------------------------------------------------------------------
    def run(self, max_steps: int | None = None) -> dict:
        """Train from the current step to cfg.steps, or until max_minutes have passed or `max_steps`
        steps were taken in this call (checkpointed either way); returns the final state."""
        cfg = self.cfg
        first = self.step
        started = time.perf_counter()
        base_elapsed = self.elapsed_s
        if self.step == 0 and not self.history:
            self.history.append({"step": 0, "heldout": self.heldout_fn()})
            self.save()
        bar = tqdm(total=cfg.steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True)
        last_heldout = next((h["heldout"] for h in reversed(self.history) if "heldout" in h), None)
        while self.step < cfg.steps and (max_steps is None or self.step - first < max_steps):
            for group in self.optimizer.param_groups:
                group["lr"] = learning_rate(cfg, self.step)
            self.optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for index in range(cfg.accumulate):
                with torch.enable_grad():  # the CLI runs with autograd off
                    loss = self.loss_fn(self.step, index) / cfg.accumulate
                    loss.backward()
                total += float(loss.detach())
            norm = float(torch.nn.utils.clip_grad_norm_(list(self.params.values()), cfg.clip))
            self.optimizer.step()
            self.step += 1
            self.elapsed_s = base_elapsed + time.perf_counter() - started
            row = {"step": self.step, "train": total, "grad_norm": norm, "lr": learning_rate(cfg, self.step - 1)}
            if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                row["heldout"] = last_heldout = self.heldout_fn()
            self.history.append(row)
            bar.update(1)
            bar.set_postfix(train=f"{total:.3f}", heldout=f"{last_heldout:.3f}" if last_heldout else "-")
            out_of_time = (cfg.max_minutes is not None and (time.perf_counter() - started) / 60 >= cfg.max_minutes) \
                or (max_steps is not None and self.step - first >= max_steps)
            if self.step % cfg.save_every == 0 or self.step == cfg.steps or out_of_time:
                self.save()
            if out_of_time:
                break
        bar.close()
        return {"step": self.step, "done": self.step >= cfg.steps, "elapsed_s": self.elapsed_s,
                "heldout": last_heldout}


def _atomic(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    tmp.replace(path)


def config_from(args: dict) -> TrainConfig:
    """A TrainConfig from the CLI's values (None: the default)."""
    names = {f.name for f in fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in args.items() if k in names and v is not None})


def loss_label(cfg: TrainConfig) -> str:
    """What the run's train and held-out losses measure (the curve's y axis)."""
    kl = f"KL to the full-context model ({'answer' if cfg.kd_span == 'answer' else 'question + answer'})"
    weight = "" if cfg.ce_weight == 1 else f"{cfg.ce_weight:g} x "
    return {"ce": "answer cross-entropy", "kd": kl, "ce+kd": f"{weight}answer cross-entropy + {kl}"}[cfg.loss] \
        + ", nats / token"


def plot_history(history: list[dict], path: str | Path, title: str | None = None,
                 ylabel: str = "answer cross-entropy, nats / token") -> Path:
    """Train loss (each step, and a running mean over 20) and held-out loss against the step, as PNG."""
    from cachetune.eval.report import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [h["step"] for h in history if "train" in h]
    train = [h["train"] for h in history if "train" in h]
    ax.plot(steps, train, color="0.8", lw=0.8, label="train (per step)")
    window = 20
    smooth = [sum(train[max(0, i - window + 1): i + 1]) / len(train[max(0, i - window + 1): i + 1])
              for i in range(len(train))]
    ax.plot(steps, smooth, color="C0", label=f"train (mean of {window})")
    held = [(h["step"], h["heldout"]) for h in history if "heldout" in h]
    ax.plot([s for s, _ in held], [v for _, v in held], "o-", color="C3", label="held-out")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.legend()
    return save_figure(fig, path, title)
