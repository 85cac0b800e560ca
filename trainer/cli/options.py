"""The flags of ``python -m trainer`` (training) and their documented defaults. Every flag's parser
default is None, so that --resume can tell given flags from defaults; trainer/cli/resolve.py fills
the defaults in."""
from __future__ import annotations

import argparse

from lfm2jit.model.lora import DEFAULT_TARGETS

from .report import BACKENDS
from ..trainer import DEFAULT_PACK_TOKENS, DEFAULT_REPLAY_PASSES

# Defaults of the run `python -m trainer` does with no arguments: a small model trained from
# scratch on the shipped chat data, small enough for a CPU driver and large enough to get most
# held-out answers right. initializer_range 0.05 (transformers' default is 0.02): at this width
# the larger start learned the lookups sooner in PyTorch trials of this data.
DEMO_PRESET = "demo"
DEMO_SHAPE = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, layer_types=["conv", "full_attention"], block_multiple_of=16,
                  initializer_range=0.05)
DEMO_STEPS = 2500
DEMO_LR = 3e-3
DEMO_CHECK_LOSS_DROP = 0.5     # with no arguments: exit 1 unless eval loss after <= 0.5 * before

FINETUNE_LR = 5e-5
DEFAULT_ACCUM = 4
DEFAULT_MAX_LEN = 512
DEFAULT_EVAL_FRACTION = 0.05
DEFAULT_EVAL_MAX = 200
MIN_EVAL_SEQUENCES = 8       # the fewest a run of known length evaluates without --eval-max
DEFAULT_KEEP = 2
DEFAULT_CHECKPOINT_MINUTES = 10.0
DEFAULT_SAMPLES = 5
DEFAULT_BETA = 0.1

SCHEDULES = ("constant", "warmup", "cosine", "linear")


EPILOG = """\
examples:
  python -m trainer                                   # the main job: tiny LFM2 from scratch, a few minutes on CPU
  python -m trainer --preset tiny --steps 50 --out runs/tiny
  python -m trainer --model DIR --data chat.jsonl --lr 2e-5 --epochs 1 --grad-accum 8
  python -m trainer --resume runs/tiny --steps 100    # continue a run from its latest checkpoint
  python -m trainer generate --model runs/tiny/model --prompt "What is 3 + 4?"   # talk to it (generate --help)
  python -m trainer eval --model runs/tiny/model --data held_out.jsonl            # score it alone (eval --help)
  python -m trainer export-gguf --model runs/tiny/model --out tiny.gguf         # for llama.cpp (export-gguf --help)
  python -m trainer --model DIR --data d.jsonl --sync-dir /shared/sync --rank 0 --world-size 2 --out runs/x &
  python -m trainer --model DIR --data d.jsonl --sync-dir /shared/sync --rank 1 --world-size 2 --out runs/x

defaults that depend on the mode:
  from scratch (no --model): --preset demo --lr 3e-3 --loss-on all, and on the built-in data --steps 2500
  fine-tuning (--model DIR):  --lr 5e-5 --loss-on assistant
  otherwise --epochs 1 when neither --steps nor --epochs is given
  python -m trainer with no arguments at all also implies --check-loss-drop 0.5

exit status: 0 done, 1 training failed (or --check-loss-drop not met), 2 bad usage or input
"""


DPO_EPILOG = """\
examples:
  python -m trainer dpo --model DIR --data prefs.jsonl --lora-r 8 --lr 5e-6 --beta 0.1 --out runs/dpo
  python -m trainer dpo --resume runs/dpo --steps 200     # continue, with the run's reference log-probs

--data holds preference records in TRL's formats, one JSON object a line:
  {"prompt": "...", "chosen": "...", "rejected": "..."}                       (standard)
  {"prompt": [messages], "chosen": [messages], "rejected": [messages]}        (conversational)
  {"chosen": [messages], "rejected": [messages]}                              (implicit prompt)
--grad-accum counts pairs; --epochs passes over the training pairs.

exit status: 0 done, 1 training failed (or --check-loss-drop not met), 2 bad usage or input
"""

GRPO_EPILOG = """\
examples:
  python -m trainer grpo --model DIR --prompts prompts.jsonl --reward exact_match --lora-r 8 --out runs/grpo
  python -m trainer grpo --model DIR --prompts prompts.jsonl --reward exact_match --reward rewards.py:fmt \\
      --num-generations 8 --max-completion-length 64 --beta 0.04 --lora-r 8
  python -m trainer grpo --resume runs/grpo --steps 200

--prompts holds one JSON object a line: {"prompt": "text" | [messages], ...other columns}; the other
columns (e.g. "answer") reach the reward functions as keyword arguments, f(prompts, completions,
**columns) -> list[float]. --grad-accum counts prompts per generation batch; each batch makes
--num-iterations optimizer steps; --epochs passes over the training prompts.

exit status: 0 done, 1 training failed (a reward function raised, returned a wrong length or a
non-finite value, ...), 2 bad usage or input
"""


def build_parser(objective: str = "sft") -> argparse.ArgumentParser:
    """The train command's parser (``objective`` "dpo" or "grpo": that command's): one argument group per concern."""
    if objective == "grpo":
        p = argparse.ArgumentParser(
            prog="python -m trainer grpo",
            description="Train an LFM2 model with GRPO (group relative policy optimization, as TRL's "
                        "GRPOTrainer): --model DIR --prompts prompts.jsonl --reward exact_match. Each prompt's "
                        "--num-generations completions are sampled, scored by the reward functions and "
                        "compared within their group. Every flag of python -m trainer applies, with records "
                        "read as prompts.",
            epilog=GRPO_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    elif objective == "dpo":
        p = argparse.ArgumentParser(
            prog="python -m trainer dpo",
            description="Preference-tune an LFM2 model with DPO (direct preference optimization, as TRL's "
                        "DPOTrainer) on pairs of a preferred and a rejected answer: --model DIR --data "
                        "prefs.jsonl. The reference is the model as loaded, its log-probs computed once before "
                        "the first step. Every flag of python -m trainer applies, with sequences read as pairs.",
            epilog=DPO_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    else:
        p = argparse.ArgumentParser(
            prog="python -m trainer",
            description="Train an LFM2 model on lfm2jit's WebGPU kernels. With no arguments: train a tiny LFM2 "
                        "from scratch on the shipped synthetic chat data and tokenizer, then report. With "
                        "--model DIR --data FILE.jsonl: fine-tune a Hugging Face LFM2 checkpoint. "
                        "python -m trainer dpo --help: preference tuning (DPO); python -m trainer grpo "
                        "--help: GRPO with reward functions.",
            epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_and_data(p)
    _add_optimization(p)
    _add_lora_and_frozen(p)
    _add_preference(p, objective)
    _add_grpo(p, objective)
    _add_output(p)
    _add_sync_and_device(p)
    return p


def _add_model_and_data(p: argparse.ArgumentParser) -> None:
    """The model to train and its data: --model or --preset, --tokenizer, --data, the held-out split."""
    m = p.add_argument_group("model and data")
    m.add_argument("--model", metavar="DIR",
                   help="fine-tune this Hugging Face LFM2 checkpoint: config.json, model.safetensors (or a "
                        "sharded index) and tokenizer.json in DIR. Without it a model is trained from scratch")
    m.add_argument("--preset", metavar="NAME",
                   help="shape of a model trained from scratch: demo (hidden 64, 2 layers: conv + attention; "
                        "the default), tiny, tiny-untied, 350M, 700M, 1.2B, 2.6B; vocab_size is set to the "
                        "tokenizer's size")
    m.add_argument("--tokenizer", metavar="FILE",
                   help="tokenizer.json (or a directory holding one); default: DIR/tokenizer.json with "
                        "--model, else the shipped character-level tokenizer")
    m.add_argument("--data", metavar="FILE.jsonl",
                   help='training data: one JSON object a line, {"text": ...} or chat {"messages": [{"role", '
                        '"content"}, ...]} (only assistant tokens are supervised); default: the shipped '
                        "synthetic chat dataset (3000 records)")
    m.add_argument("--data-kind", choices=("auto", "text", "chat"),
                   help="record kind of --data: auto (by each record's key; default), text or chat")
    m.add_argument("--loss-on", choices=("assistant", "all"),
                   help="targets of chat records the loss counts: assistant (only the assistant answers, as in "
                        "fine-tuning; the default with --model) or all (every next token of the rendered "
                        "conversation, as in pretraining; the default from scratch). Text records: always all")
    m.add_argument("--max-len", type=int, metavar="N",
                   help=f"at most N positions per sequence; longer records are cut (with a note) "
                        f"(default {DEFAULT_MAX_LEN})")
    m.add_argument("--eval-fraction", type=float, metavar="F",
                   help=f"hold out this fraction of the records (chosen by --seed) and report their mean loss "
                        f"before and after training; 0 disables (default {DEFAULT_EVAL_FRACTION})")
    m.add_argument("--eval-max", type=int, metavar="N",
                   help=f"evaluate at most N held-out sequences (default {DEFAULT_EVAL_MAX}; with --steps, no more "
                        f"than the run trains on, at least {MIN_EVAL_SEQUENCES})")
    m.add_argument("--eval-data", metavar="FILE",
                   help="held-out records from this JSONL file (same format as --data) instead of a fraction of "
                        "--data")
    m.add_argument("--eval-answers", type=int, metavar="N",
                   help="score the greedy answers of up to N held-out chat records (their last assistant turn) "
                        "for exact match at each evaluation; 0 disables (default: every evaluated record)")
    m.add_argument("--samples", type=int, metavar="K",
                   help=f"print K sample answers beside the expected ones at each evaluation (default {DEFAULT_SAMPLES})")
    m.add_argument("--seed", type=int, metavar="N",
                   help="seed of the initial weights (from scratch), the held-out split and the per-epoch "
                        "shuffle (default 0)")


def _add_optimization(p: argparse.ArgumentParser) -> None:
    """The optimizer, its schedule, the batch and the run's length."""
    o = p.add_argument_group("optimization")
    o.add_argument("--optimizer", choices=("adamw", "sgd"), help="adamw (torch.optim.AdamW; default) or sgd "
                                                                 "(torch.optim.SGD)")
    o.add_argument("--lr", type=float, metavar="LR",
                   help=f"peak learning rate (default {DEMO_LR:g} from scratch, {FINETUNE_LR:g} with --model)")
    o.add_argument("--weight-decay", type=float, metavar="WD",
                   help="weight decay: decoupled for adamw (default 0.01), added to the gradient for sgd "
                        "(default 0)")
    o.add_argument("--momentum", type=float, metavar="M", help="sgd momentum (default 0.9; adamw ignores it)")
    o.add_argument("--schedule", choices=SCHEDULES,
                   help="learning-rate schedule over the optimizer steps: constant; warmup (linear warmup, then "
                        "constant); cosine (warmup, then cosine down to --min-lr; default); linear (warmup, then "
                        "linear down to --min-lr)")
    o.add_argument("--warmup-steps", type=int, metavar="N",
                   help="warmup steps of the warmup/cosine/linear schedules (default 5%% of the steps)")
    o.add_argument("--min-lr", type=float, metavar="LR",
                   help="final learning rate of the cosine and linear schedules (default lr / 10)")
    o.add_argument("--grad-accum", type=int, metavar="N",
                   help=f"sequences per optimizer step (per rank): the batch size; the update is the mean over "
                        f"them (default {DEFAULT_ACCUM})")
    o.add_argument("--pack-tokens", type=int, metavar="N",
                   help="run the sequences of a step packed, up to N positions per pass (padded to the longest); "
                        f"0 = one sequence per pass (default {DEFAULT_PACK_TOKENS})")
    o.add_argument("--packing", metavar="pad|concat|auto",
                   help="how a pass packs its sequences: pad (padded to the longest and stacked) or concat "
                        "(concatenated into one row with no padding between them: attention, the short conv and "
                        "RoPE restart at every sequence); auto (default): concat on a GPU, pad on a CPU adapter")
    o.add_argument("--replay", type=int, metavar="N",
                   help="record the forward/backward pass of up to N input shapes and replay them (with the norm "
                        "and optimizer steps) instead of running Python per kernel; each kept pass holds its "
                        f"activations; 0 = off. Same results either way (default {DEFAULT_REPLAY_PASSES})")
    o.add_argument("--clip", type=float, metavar="NORM",
                   help="clip the global gradient L2 norm to NORM (torch.nn.utils.clip_grad_norm_); 0 = off "
                        "(default 1.0)")
    o.add_argument("--bucket", type=int, metavar="N",
                   help="length bucket: kernels are compiled for lengths rounded up to a multiple of N, "
                        "so every length in a bucket reuses them (default 64)")
    o.add_argument("--scaler", action="store_true", default=None,
                   help="dynamic loss scaling (GradScaler: scale 2**16, x0.5 and skip the step on inf/NaN "
                        "gradients, x2 after 2000 clean steps)")
    o.add_argument("--f16", action="store_true", default=None,
                   help="mixed precision: activations and their gradients stored as f16 (half the activation "
                        "memory and traffic); weights, gradients and optimizer state stay f32 and every kernel "
                        "computes in f32. Turns on --scaler (f16 gradients need loss scaling). Needs an adapter "
                        "with shader-f16")
    o.add_argument("--router-aux-loss-coef", type=float, metavar="C",
                   help="an LFM2-MoE model: add C times the routers' load-balancing loss (even load: 1 per sparse "
                        "layer) to the gradients; metrics.jsonl logs it as router_aux_loss. Default 0: off, as "
                        "fine-tuning recipes leave it")
    o.add_argument("--recompute-mlp", action="store_true", default=None,
                   help="backward recomputes each layer's MLP up-projections instead of keeping them: the largest "
                        "activations, for two more matmuls per layer. Same results")
    o.add_argument("--checkpoint-layers", metavar="all|N",
                   help="activation checkpointing: training passes keep only the input of each of the first N "
                        "decoder layers (all: every layer) and the backward runs the layer's forward again, for "
                        "about one more forward of those layers per step. Same results (default: off)")
    length = o.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, metavar="N",
                        help="train until optimizer step N (total, counting steps before a --resume)")
    length.add_argument("--epochs", type=float, metavar="E",
                        help="train for E passes over the training split (E may be fractional; default 1 unless "
                             "--steps is given or the built-in run is done)")


def _add_lora_and_frozen(p: argparse.ArgumentParser) -> None:
    """Which parameters train: LoRA adapters, --train-only, --freeze."""
    lo = p.add_argument_group("LoRA and frozen parameters (by default every parameter is trained)")
    lo.add_argument("--lora-r", type=int, metavar="R",
                    help="train LoRA adapters of rank R (PEFT's LoraConfig) instead of the whole model; the base "
                         "weights stay frozen")
    lo.add_argument("--lora-alpha", type=float, metavar="A", help="LoRA alpha; the update is scaled by A / R "
                    "(default 2 R: Liquid's recipe uses R 8, alpha 16)")
    lo.add_argument("--lora-targets", nargs="+", metavar="NAME",
                    help=f"linear layers that get adapters, matched as PEFT matches target_modules (a module name "
                         f"or its last part); default LFM2's every linear layer: {' '.join(DEFAULT_TARGETS)}")
    lo.add_argument("--lora-target-parameters", nargs="+", metavar="NAME",
                    help="an MoE model's expert tensors that get adapters too, as PEFT's target_parameters "
                         "(e.g. experts.gate_up_proj experts.down_proj: one rank-R pair per expert; "
                         "PeftModel.from_pretrained loads the result); default none")
    lo.add_argument("--lora-dropout", type=float, metavar="P",
                    help="LoRA dropout probability, PEFT's lora_dropout: each adapter's input elements dropped "
                         "with probability P in training (masks drawn on the GPU; default 0)")
    lo.add_argument("--lora-f16-base", action="store_true", default=None,
                    help="keep the frozen base's linear weights as f16: half their memory (--base-dtype f16)")
    lo.add_argument("--base-dtype", choices=("f32", "f16", "int8", "nf4"),
                    help="how the frozen base's decoder linear weights are held: f32 (default), f16, int8 per "
                         "output channel, or nf4 (QLoRA's 4-bit blocks of 64), quantized as they are loaded and "
                         "decoded inside the GEMMs")
    lo.add_argument("--merge-lora", action="store_true", default=None,
                    help="at the end, fold the adapters into the base and write the merged model to OUT/model "
                         "(default: the adapter alone, to OUT/adapter, which PeftModel.from_pretrained loads)")
    lo.add_argument("--train-only", nargs="+", metavar="PATTERN",
                    help="train only the parameters whose transformers names match one of these shell patterns "
                         "(e.g. 'lm_head.weight' 'model.layers.15.*'); with --lora-r, train these too")
    lo.add_argument("--freeze", nargs="+", metavar="PATTERN",
                    help="do not train the parameters whose names match one of these shell patterns")


def _add_preference(p: argparse.ArgumentParser, objective: str) -> None:
    """DPO's settings: parsed by the other commands too, which refuse them naming the dpo command (--beta
    and --loss-type are GRPO's too)."""
    if objective == "grpo":
        d = p.add_argument_group("GRPO's loss (--beta and --loss-type as TRL's GRPOConfig)")
        d.add_argument("--beta", type=float, metavar="B",
                       help="the KL term's weight against the reference (the starting model; for LoRA its base) "
                            "(default 0, TRL's: no reference)")
        d.add_argument("--loss-type", metavar="{grpo,dr_grpo,dapo}",
                       help="the loss normalisation: grpo (mean over completions of each one's token mean), "
                            "dr_grpo (token sum / (completions x --max-completion-length)) or dapo (token sum / "
                            "the batch's completion tokens; the default, TRL's)")
        d.add_argument("--label-smoothing", type=float, metavar="EPS", help="DPO only (python -m trainer dpo)")
        return
    d = p.add_argument_group("preference tuning (dpo)" if objective == "dpo" else
                             "preference tuning (only with python -m trainer dpo)")
    d.add_argument("--beta", type=float, metavar="B",
                   help=f"DPO's beta: how far the policy may move from the reference (default {DEFAULT_BETA:g}, TRL's)")
    d.add_argument("--loss-type", metavar="{sigmoid,ipo}",
                   help="sigmoid (DPO's loss; the default) or ipo (IPO's squared loss on the length-averaged "
                        "log-ratios), as TRL's loss_type")
    d.add_argument("--label-smoothing", type=float, metavar="EPS",
                   help="the sigmoid loss's label smoothing (conservative DPO), in [0, 0.5) (default 0)")


def _add_grpo(p: argparse.ArgumentParser, objective: str) -> None:
    """GRPO's settings: parsed by the other commands too, which refuse them naming the grpo command."""
    only = "" if objective == "grpo" else " (only with python -m trainer grpo)"
    g = p.add_argument_group(f"GRPO{only}")
    if objective == "grpo":
        g.add_argument("--prompts", metavar="FILE.jsonl", dest="data",
                       help='the prompts: {"prompt": "text" | [messages], ...columns} one a line (--data is the '
                            "same flag)")
    g.add_argument("--reward", action="append", metavar="SPEC",
                   help="a reward function (repeat for several; their rewards add up): exact_match (the stripped "
                        "completion equals the record's 'answer'), regex:PATTERN (the stripped completion matches "
                        "in full), module:function or path/to/file.py:function, called as f(prompts, completions, "
                        "**columns) -> list[float] (default exact_match)")
    g.add_argument("--num-generations", type=int, metavar="G",
                   help="completions sampled per prompt, compared within their group (default 8, >= 2)")
    g.add_argument("--max-completion-length", type=int, metavar="N",
                   help="at most N new tokens per completion (default 512); also the held-out greedy answers'")
    g.add_argument("--temperature", type=float, metavar="T", help="sampling temperature (default 1)")
    g.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling's top-p, in (0, 1] (default 1)")
    g.add_argument("--epsilon", type=float, metavar="E",
                   help="the ratio's clip range: [1 - E, 1 + E], E in [0, 1) (default 0.2)")
    g.add_argument("--epsilon-high", type=float, metavar="E",
                   help="the clip range's upper side, 1 + E (DAPO's clip-higher; default --epsilon)")
    g.add_argument("--num-iterations", type=int, metavar="K",
                   help="optimizer steps per generation batch (TRL's num_iterations, mu; default 1)")
    g.add_argument("--eval-generations", type=int, metavar="N",
                   help="the held-out evaluation also samples N completions per prompt at --temperature / --top-p "
                        "(the same seed at every evaluation) and reports their mean reward and exact match, as "
                        "TRL's sampled evaluation does; greedy answers hide a sharpened distribution (default 0: "
                        "greedy only)")
    g.add_argument("--scale-rewards", choices=("group", "batch", "none"),
                   help="advantages divided by the group's reward std (default), the batch's, or not at all")


def _add_output(p: argparse.ArgumentParser) -> None:
    """The run directory, checkpoints, --resume, evaluations and reporting."""
    c = p.add_argument_group("output, checkpoints, resume")
    c.add_argument("--out", metavar="DIR",
                   help="run directory for metrics.jsonl, loss.png, summary.json, run.json and checkpoints/ "
                        "(default runs/<date>-<time>; with --world-size > 1 runs/<run-id>; with --resume the run "
                        "directory holding the checkpoint, whose metrics.jsonl is continued)")
    c.add_argument("--overwrite", action="store_true", default=None,
                   help="let a fresh run use an --out that holds another run: that run's files (run.json, "
                        "metrics.jsonl, checkpoints/, model/, ...) are removed first; refused if DIR holds anything "
                        "else. Without it such an --out is refused")
    c.add_argument("--checkpoint-every", type=int, metavar="N",
                   help="also checkpoint every N optimizer steps; 0: only at the end (and on Ctrl-C/SIGTERM). "
                        "Default: N chosen from the measured step time after the first 10 steps so that a "
                        "checkpoint is written about every --checkpoint-minutes of training (none in runs shorter "
                        "than that)")
    c.add_argument("--checkpoint-minutes", type=float, metavar="M",
                   help="without --checkpoint-every: checkpoint about every M minutes of training "
                        f"(default {DEFAULT_CHECKPOINT_MINUTES:g})")
    c.add_argument("--keep-checkpoints", type=int, metavar="K",
                   help=f"keep only the newest K checkpoints of the run; 0 keeps all (default {DEFAULT_KEEP})")
    c.add_argument("--resume", metavar="DIR",
                   help="continue from a checkpoint (DIR/trainer.json) or a run directory's newest checkpoint: "
                        "weights, optimizer, scaler, schedule, data position and the run's settings")
    c.add_argument("--save-dtype", choices=("f32", "bf16", "f16"),
                   help="dtype of the final model written to OUT/model (default: the input model's, f32 from "
                        "scratch); checkpoints stay f32 so that --resume is exact")
    c.add_argument("--eval-every", type=int, metavar="N",
                   help="also score the held-out split every N optimizer steps: printed, written to eval.jsonl and "
                        "drawn in loss.png (default 0: before and after training only)")
    c.add_argument("--check-loss-drop", type=float, metavar="F",
                   help="exit with status 1 unless the held-out loss after training is at most F times the loss "
                        f"before (default: off; {DEMO_CHECK_LOSS_DROP} for the no-argument run)")
    c.add_argument("--no-progress", action="store_true", default=None, help="no progress bar")
    c.add_argument("--report-to", nargs="+", choices=BACKENDS, metavar="BACKEND",
                   help="also log the settings, every step's metrics.jsonl scalars (train/KEY) and the evaluations "
                        "(eval/KEY) to tensorboard (event files in OUT/tensorboard; pip install tensorboardX), "
                        "wandb (files in OUT/wandb) and/or mlflow (MLFLOW_TRACKING_URI, else the SQLite store OUT/mlflow.db) "
                        "(default: none)")


def _add_sync_and_device(p: argparse.ArgumentParser) -> None:
    """Several processes averaging their gradients, and the GPU adapter."""
    s = p.add_argument_group("multi-process gradient sync (FileGradSync or MPI) and device")
    s.add_argument("--distributed", choices=("file", "mpi"),
                   help="how ranks average their gradients: file (through --sync-dir, the default) or mpi (launch "
                        "with mpiexec -n N python -m trainer ... --distributed mpi: rank and world size from MPI; "
                        "pip install mpi4py mpich)")
    s.add_argument("--sync-dir", metavar="DIR",
                   help="shared directory through which --world-size processes average their gradients every "
                        "optimizer step; start one process per rank with the same flags")
    s.add_argument("--rank", type=int, metavar="R", help="this process's rank, 0 .. world-size - 1 (default 0)")
    s.add_argument("--world-size", type=int, metavar="N", help="number of processes (default 1)")
    s.add_argument("--run-id", metavar="ID",
                   help="name of the run's sync files, so files of another run are never mixed in: 1 to 64 letters, "
                        "digits, '.', '_', '-', starting with a letter or digit (default run)")
    s.add_argument("--sync-timeout", type=float, metavar="S",
                   help="seconds to wait for the other ranks at a step before failing (default 600)")
    s.add_argument("--gpu", metavar="SUBSTRING",
                   help="use the GPU (WebGPU adapter) whose name/vendor/backend contains SUBSTRING (sets "
                        "LFM2JIT_ADAPTER), as generate and eval take it (there --adapter DIR is a LoRA adapter)")
    s.add_argument("--adapter", metavar="DIR", help=argparse.SUPPRESS)   # a LoRA directory elsewhere: refused here
