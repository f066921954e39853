"""`Autotuner`: the model-info run, the experiments, the records and the results (DeepSpeed's flow).

1. model-info run: the user's config at micro-batch 1, ZeRO stage 3, ``autotuning.model_info.profile``
   on; the engine writes parameters and activation memory per sample and exits after one forward
   (skipped when ``autotuning.model_info.num_params`` is given).
2. experiments: the stages to tune x the micro-batch sizes (DeepSpeed's constant samples per rank per
   step), with the optimizer offloaded for a stage that does not fit on an accelerator; those whose
   estimated memory exceeds the rank's memory are pruned (never run).
3. the tuner (``tuner_type``) runs them, each a short real run measured by ``metric``; with ``fast``
   false, ``reduce_bucket_size`` is then tuned at the best stage and micro-batch size.
4. ``results_dir``: summary.txt (a table of every experiment), results.json, ds_config_optimal.json and
   cmd_optimal.txt, each written atomically.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence

from . import _space
from ._config import AutotuningConfig
from ._resources import ResourceManager, normalize_arg_mappings
from ._runner import Runner, config_index, write_atomic, write_json
from ._tuners import TUNERS

log = logging.getLogger("ds_autotune")


class Autotuner:
    """``Autotuner(script, script_args, num_gpus=2).tune()`` then ``write_results()`` (and
    ``run_after_tuning()`` for ``run``); see the module docstring."""

    def __init__(self, user_script: str, user_args: Sequence[str], *, num_gpus: int | None = None,
                 num_nodes: int | None = None, active_resources: Mapping[str, Sequence[int]] | None = None,
                 launcher_args: Sequence[str] = (), memory_per_gpu: int | None = None,
                 seed: int | None = None, exp_timeout: float = 600.0) -> None:
        for name, value in (("num_gpus", num_gpus), ("num_nodes", num_nodes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"ds-autotune: {name} must be an integer >= 1 or None (not given), got {value!r}")
        path = list(user_args)[config_index(user_args)]
        path = path.split("=", 1)[1] if path.startswith("--") else path
        if not os.path.isfile(path):
            raise ValueError(f"ds-autotune: the DeepSpeed config {path!r} is not a file")
        with open(path) as f:
            self.user_config = json.load(f)
        self.config = AutotuningConfig.from_dict(self.user_config.get("autotuning"))
        self.results_dir, self.exps_dir = self.config.results_dir, self.config.exps_dir
        # the command line's numbers win over the section's; with active_resources, the pool's fill the rest
        num_gpus, num_nodes = num_gpus or self.config.num_gpus, num_nodes or self.config.num_nodes
        self.resources: ResourceManager | None = None
        if active_resources is None:
            self.exp_num_gpus, self.exp_num_nodes = num_gpus or 1, num_nodes or 1
            resource_options = [f"--num_gpus={num_gpus}"] if num_gpus else []
            resource_options += [f"--num_nodes={num_nodes}"] if num_nodes else []
        else:
            self.resources = ResourceManager.from_active_resources(
                active_resources, results_dir=self.results_dir, exps_dir=self.exps_dir,
                arg_mappings=self.config.arg_mappings)
            self.exp_num_nodes, self.exp_num_gpus = self.resources.experiment_resources(num_nodes, num_gpus)
            resource_options = self._resource_options(launcher_args)
        self.memory_per_gpu, self.seed = memory_per_gpu, seed
        if self.config.overwrite:
            for d in (self.results_dir, self.exps_dir):
                shutil.rmtree(d, ignore_errors=True)
        os.makedirs(self.results_dir, exist_ok=True)
        os.makedirs(self.exps_dir, exist_ok=True)
        self.runner = Runner(user_script, user_args, results_dir=self.results_dir, exps_dir=self.exps_dir,
                             launcher_args=[*launcher_args, *resource_options], overwrite=self.config.overwrite,
                             timeout=exp_timeout,
                             arg_mappings=normalize_arg_mappings(self.config.arg_mappings))
        self.records: list[dict] = []  # every experiment: name, ds_config, status, metric
        self.model_info: dict | None = None
        self.best: dict | None = None
        self.start_time = time.time()

    def _resource_options(self, launcher_args: Sequence[str]) -> list[str]:
        """The launcher options that give each experiment its hosts and slots out of ``self.resources``."""
        given = {word.split("=", 1)[0] for word in launcher_args}
        clash = given & {"--include", "-i", "--exclude", "-e", "--num_gpus", "--num_nodes"}
        if clash:
            raise ValueError(f"ds-autotune: active_resources already say which hosts and slots to use; "
                             f"{', '.join(sorted(clash))} in launcher_args cannot be combined with them")
        selection = self.resources.select(self.exp_num_nodes, self.exp_num_gpus)
        if list(selection) == ["localhost"] and selection["localhost"] == list(range(self.exp_num_gpus)) \
                and not given & {"--hostfile", "-H"}:
            return [f"--num_gpus={self.exp_num_gpus}"]  # this machine's first slots (also without accelerators)
        return [f"--include={self.resources.include(self.exp_num_nodes, self.exp_num_gpus)}"]

    # ------------------------------------------------------------------------------ steps
    @property
    def total_gpus(self) -> int:
        return self.exp_num_gpus * self.exp_num_nodes

    def fp16(self) -> bool:
        return bool(self.user_config.get("fp16", {}).get("enabled", False) is True)

    def model_info_profile_run(self) -> dict | None:
        """Parameters and activation memory per sample: from ``autotuning.model_info`` when it gives
        ``num_params``, else from a run of the script at micro-batch 1, stage 3."""
        given = self.config.model_info or {}
        if given.get("num_params"):
            log.info("model info from the config: %s", given)
            return {"activation_mem_per_gpu": 0, **given}
        log.info("model info profile run (micro-batch 1, ZeRO stage 3, one forward)")
        cfg = _space.first_config({k: v for k, v in self.user_config.items() if k != "autotuning"})
        cfg.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1,
                   train_batch_size=self.total_gpus // self.config.mp_size or 1)
        cfg["zero_optimization"] = {"stage": 3}
        cfg["autotuning"] = {"enabled": True, "model_info": {"profile": True}}
        exp = {"name": "profile_model_info", "ds_config": cfg, "num_gpus": self.exp_num_gpus,
               "num_nodes": self.exp_num_nodes}
        info = self.runner.run(exp, output_key="model_info_path", output_name="model_info.json")
        if info is None:
            log.error("the model-info run failed (%s): the script does not run with this config",
                      exp.get("error"))
        return info

    def experiments(self, memory: int) -> tuple[list[dict], list[dict]]:
        """(experiments to run, pruned ones) over the stages and micro-batch sizes."""
        info = self.model_info
        act = max(int(info.get("activation_mem_per_gpu") or 0), 1)
        stages = _space.user_stages(self.user_config)
        accelerator = info.get("device_type", "cpu") != "cpu"
        per_stage = {}
        for stage in stages:
            inst = _space.instantiation_memory(info["num_params"], stage, self.total_gpus, fp16=self.fp16(),
                                               mp_size=self.config.mp_size)
            per_stage[stage] = max(int((memory - inst) // act), 0)
        top = max(per_stage.values(), default=0)
        sizes = _space.micro_batch_sizes(self.user_config, self.config, top)
        per_gpu = _space.max_train_batch_size_per_gpu(self.user_config, self.config, sizes, self.total_gpus)
        exps = []
        for stage in stages:
            variants = [False]
            # offload where it helps and fits: on an accelerator, for a stage whose largest size does not fit
            if accelerator and stage > 0 and sizes and per_stage[stage] < max(sizes):
                variants.append(True)
            for offload in variants:
                for mbs in sizes:
                    exps.append(_space.make_experiment(self.user_config, self.config, stage=stage, mbs=mbs,
                                                       max_per_gpu=per_gpu, num_gpus=self.exp_num_gpus,
                                                       num_nodes=self.exp_num_nodes, offload=offload))
        small = [e for e in exps if e["ds_config"]["train_batch_size"] < self.config.min_train_batch_size]
        for exp in small:
            log.info("skipped %s: train_batch_size %d is below autotuning.min_train_batch_size %d", exp["name"],
                     exp["ds_config"]["train_batch_size"], self.config.min_train_batch_size)
        exps = [e for e in exps if all(e is not s for s in small)]
        return _space.prune(exps, info, memory, self.total_gpus, self.fp16(), self.config.mp_size)

    def evaluate(self, exps: list[dict]) -> list[float | None]:
        """Run each experiment; its metric (None when it failed)."""
        out = []
        for exp in exps:
            at = exp["ds_config"].setdefault("autotuning", {})
            at.update(enabled=True, start_profile_step=self.config.start_profile_step,
                      end_profile_step=self.config.end_profile_step, metric=self.config.metric)
            log.info("[%d] running %s (stage %d, micro-batch %d, accumulation %d)", len(self.records) + 1,
                     exp["name"], exp["ds_config"]["zero_optimization"]["stage"],
                     exp["ds_config"]["train_micro_batch_size_per_gpu"],
                     exp["ds_config"]["gradient_accumulation_steps"])
            result = self.runner.run(exp)
            value = result.get(self.config.metric_key) if result else None
            value = float(value) if isinstance(value, (int, float)) else None
            self.records.append({"name": exp["name"], "status": "ok" if value is not None else "failed",
                                 "metric": value, "wall_s": round(exp.get("wall_s", 0.0), 3),
                                 "ds_config": exp["ds_config"], "result_dir": exp.get("result_dir"),
                                 "error": exp.get("error")})
            if value is not None:
                log.info("    %s: %s = %.6g (%.1f s)", exp["name"], self.config.metric, value, exp.get("wall_s", 0))
            out.append(value)
        return out

    def _tuner(self, exps: list[dict]):
        cls = TUNERS[self.config.tuner_type]
        return cls(exps, self.evaluate, higher_is_better=self.config.higher_is_better, seed=self.seed)

    def tune(self) -> dict | None:
        """Tune; returns the best record (None when nothing ran)."""
        self.start_time = time.time()
        log.info("autotuning %s on %d rank(s) x %d node(s): metric %s, tuner %s, fast %s", self.runner.user_script,
                 self.exp_num_gpus, self.exp_num_nodes, self.config.metric, self.config.tuner_type, self.config.fast)
        self.model_info = self.model_info_profile_run()
        if not self.model_info or not self.model_info.get("num_params"):
            return None
        memory = self.memory_per_gpu or _space.memory_per_rank(self.model_info, self.exp_num_gpus)
        log.info("the model has %d parameters, %s activation memory per sample; %s memory per rank",
                 self.model_info["num_params"], _space.memory_string(self.model_info.get("activation_mem_per_gpu", 0)),
                 _space.memory_string(memory))
        exps, pruned = self.experiments(memory)
        for exp in pruned:
            self.records.append({"name": exp["name"], "status": "pruned", "metric": None, "wall_s": 0.0,
                                 "ds_config": exp["ds_config"], "required_memory": exp["required_memory"]})
        log.info("%d experiments to tune, %d pruned (do not fit in memory)", len(exps), len(pruned))
        if not exps:
            log.error("no configuration fits in %s per rank", _space.memory_string(memory))
            return None
        tuner = self._tuner(exps)
        tuner.tune(sample_size=1, n_trials=self.config.tuner_num_trials, early_stopping=self.config.tuner_early_stopping)
        best = tuner.best_exp
        if best is not None and not self.config.fast and best["ds_config"]["zero_optimization"]["stage"] > 0:
            best = self._tune_zero_knobs(best, tuner.best_metric_val) or best
        self.best = next((r for r in self.records if best is not None and r["name"] == best["name"]), None)
        return self.best

    def _tune_zero_knobs(self, best: dict, best_val: float) -> dict | None:
        cfg = best["ds_config"]
        stage, mbs, gas = (cfg["zero_optimization"]["stage"], cfg["train_micro_batch_size_per_gpu"],
                           cfg["gradient_accumulation_steps"])
        log.info("fast is false: tuning %s at stage %d, micro-batch %d", ", ".join(_space.SLOW_MODE_SPACE), stage, mbs)
        exps = []
        for key, values in _space.SLOW_MODE_SPACE.items():
            for value in values:
                exps.append(_space.make_experiment(
                    self.user_config, self.config, stage=stage, mbs=mbs, max_per_gpu=mbs * gas,
                    num_gpus=self.exp_num_gpus, num_nodes=self.exp_num_nodes,
                    offload=bool(cfg["zero_optimization"].get("offload_optimizer")), extra={key: value}))
        tuner = self._tuner(exps)
        tuner.tune(sample_size=1, n_trials=self.config.tuner_num_trials, early_stopping=self.config.tuner_early_stopping)
        if tuner.best_exp is not None and tuner.better(tuner.best_metric_val, best_val):
            return tuner.best_exp
        return None

    # ------------------------------------------------------------------------------ results
    def summary(self) -> str:
        """The table of every experiment (best first), then the best and the time taken."""
        sign = -1.0 if self.config.higher_is_better else 1.0
        rows = sorted(self.records, key=lambda r: (r["metric"] is None, sign * (r["metric"] or 0.0)))
        head = ["exp_name", "stage", "offload", "micro_batch", "grad_acc", "train_batch", self.config.metric,
                "status", "wall_s"]
        table = [head]
        for r in rows:
            c = r["ds_config"]
            z = c.get("zero_optimization", {})
            table.append([r["name"], str(z.get("stage")), "cpu" if z.get("offload_optimizer") else "-",
                          str(c["train_micro_batch_size_per_gpu"]), str(c["gradient_accumulation_steps"]),
                          str(c["train_batch_size"]), "-" if r["metric"] is None else f"{r['metric']:.6g}",
                          r["status"], f"{r['wall_s']:.1f}"])
        widths = [max(len(row[i]) for row in table) for i in range(len(head))]
        lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) + " |" for row in table]
        lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
        ran = sum(r["status"] != "pruned" for r in self.records)
        took = time.time() - self.start_time
        best = f"{self.best['name']} is the optimal setup ({self.config.metric} {self.best['metric']:.6g})" \
            if self.best else "no optimal setup found: check the experiments' stderr.log"
        return "\n".join(lines) + f"\n\n{best}.\nTuning completed in {took:.1f} s. Experiments run: {ran}, " \
            f"pruned: {len(self.records) - ran}.\n"

    def optimal_command(self) -> list[str] | None:
        if self.best is None:
            return None
        path = os.path.abspath(os.path.join(self.results_dir, "ds_config_optimal.json"))
        return self.runner.command(self.best, path)

    def write_results(self) -> None:
        """`write_summary` then `write_optimal_config`; the summary is logged."""
        text = self.write_summary()
        self.write_optimal_config()
        for line in text.splitlines():
            log.info("%s", line)

    def write_summary(self) -> str:
        """summary.txt (`summary`) and results.json (every experiment, the model info, the best) in
        ``results_dir``, each written atomically; returns the summary."""
        text = self.summary()
        write_atomic(os.path.join(self.results_dir, "summary.txt"), text)
        write_json(os.path.join(self.results_dir, "results.json"),
                   {"metric": self.config.metric, "model_info": self.model_info, "best": self.best,
                    "experiments": self.records})
        return text

    def write_optimal_config(self) -> None:
        """For the best experiment: ds_config_optimal.json (its config without the autotuning section) and
        cmd_optimal.txt (the command that trains with it) in ``results_dir``, each written atomically;
        nothing when no experiment succeeded."""
        if self.best is None:
            return
        optimal = {k: v for k, v in self.best["ds_config"].items() if k != "autotuning"}
        write_json(os.path.join(self.results_dir, "ds_config_optimal.json"), optimal)
        write_atomic(os.path.join(self.results_dir, "cmd_optimal.txt"), shlex.join(self.optimal_command()) + "\n")
        log.info("wrote the optimal config to %s and its command to %s",
                 os.path.join(self.results_dir, "ds_config_optimal.json"),
                 os.path.join(self.results_dir, "cmd_optimal.txt"))

    def run_after_tuning(self) -> int:
        """Train with the optimal config (cmd_optimal.txt); its exit code (1 when none was found)."""
        cmd = self.optimal_command()
        if cmd is None:
            log.error("no optimal configuration found by autotuning: nothing to run")
            return 1
        log.info("training with the optimal configuration: %s", shlex.join(cmd))
        return subprocess.run(cmd).returncode
