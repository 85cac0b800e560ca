"""TRL's own DPO (and GRPO) loss, metrics and gradients on a small transformers model, for testing
lfm2jit's preference training against TRL (test-only; torch, transformers, datasets and trl are
imported by the functions, so importing this module costs nothing and callers skip without them).

``trl_dpo`` builds a real ``trl.DPOTrainer`` (CPU, no logging, no dropout, no gradient
checkpointing) around the caller's model, makes ONE batch of all the pairs with TRL's own
``DataCollatorForPreference`` and calls ``DPOTrainer.compute_loss`` -> ``_compute_loss``: the
forward through TRL's fused LM head, the reference forward, the loss and TRL's metric bookkeeping
(``trainer._metrics``) all run as TRL wrote them. Then ``loss.backward()``.

The one substitution: TRL's fused LM head (``trl.kernels.ChunkedLogProbFunction``, what
``model(..., labels=labels, fused_lm_head=True)`` runs after ``trl.trainer.utils.add_fused_lm_head``
patched ``model.forward``) keeps its statistics in float32 whatever the model's dtype (``tile.float()``,
fp32 running max / sum of exps, fp32 gradient accumulators), so a float64 model gets float32 log-probs,
loss and lm_head/hidden gradients. With ``FP64_LM_HEAD = True`` (the default) that kernel is replaced,
for the duration of the call, by ``_Fp64LogProbHead``: the same five outputs (log_probs, entropy,
log_sum_sq_probs, mean_logits, is_top1) with the same conventions (temperature, logit scale, softcap,
first-argmax top-1), computed by plain autograd in the hidden states' dtype. Everything else is TRL's.
``test_trl_reference.py`` checks the substitute against TRL's kernel (they agree to float32 precision).

What TRL 1.16 does that matters when matching it (dpo_trainer.py line numbers):

- Token layout (``DataCollatorForPreference.torch_call``, l.146): row i = prompt_i + chosen_i, row n+i =
  prompt_i + rejected_i (batch = [all chosen, all rejected]), right-padded with the pad id,
  attention_mask 1 on real tokens, completion_mask 1 on the completion tokens. Given token ids NOTHING
  is added or dropped: no BOS, no EOS, no chat template (the EOS TRL appends, l.1062, and the
  tokenization, l.1075, only happen in ``_prepare_dataset`` for text datasets, which this helper
  bypasses). No truncation (max_length=None here).
- Labels (l.1298): input_ids with -100 where completion_mask == 0; the fused head shifts them
  (hidden[:, :-1] predicts labels[:, 1:]), so the log-prob of completion token t is taken from the
  position before it, i.e. the first completion token is predicted by the last prompt token.
- logps (l.1303): SUM over completion tokens of log p(token) (``ld_alpha`` None). 'logps/chosen' and
  'logps/rejected' are the batch MEANS of those per-sequence sums of the POLICY (not log-ratios).
- Log-ratios: chosen_logratio = logps_chosen - ref_logps_chosen (same for rejected);
  delta = chosen_logratio - rejected_logratio (f_divergence_type 'reverse_kl').
- 'sigmoid' (l.1387): -logsigmoid(beta * delta). NO label smoothing: label_smoothing is only read
  by 'robust', 'exo_pair', 'aot' and 'aot_unpaired' (and must be > 0 for 'exo_pair').
- 'ipo' (l.1393): per-token averages: chosen_logratio / n_chosen_tokens - rejected_logratio /
  n_rejected_tokens (token counts from completion_mask, clamp >= 1), loss (that - 1/(2 beta))^2.
- The batch loss is ``per_sequence_loss.mean()`` over the pairs (l.1528) (times loss_weight 1.0).
- Metrics (l.1535-1600), each for this one batch: 'rewards/chosen' = mean(beta * chosen_logratio),
  'rewards/rejected' likewise, 'rewards/accuracies' = mean(chosen_reward > rejected_reward) (strict),
  'rewards/margins' = mean(chosen_reward - rejected_reward) -- rewards use beta * logratio for EVERY
  loss type, IPO included (not the per-token averages); 'logps/*' as above; 'entropy' = mean over all
  completion tokens (chosen and rejected) of the next-token distribution's entropy; 'logits/chosen' /
  'logits/rejected' = mean over that side's completion tokens of the mean over the vocabulary of the
  logits; 'mean_token_accuracy' = fraction of CHOSEN completion tokens that are the argmax (first
  maximum wins ties); 'num_tokens' = attention_mask.sum() of the batch (prompt tokens of both rows
  counted, padding not).
- Reference: a separate ``ref_model`` is called as is under no_grad (TRL requires it to be a
  different object). With ``ref_model=None`` and a ``peft.PeftModel``, TRL 1.16 (peft >= 0.20) would
  add a "ref" adapter that copies the CURRENT adapter weights (l.689); this helper deletes that
  adapter again before the loss, so TRL takes its other branch (l.1333): the reference is the model
  with the adapters disabled (``use_adapter(model, None)`` -> ``model.disable_adapter()``), which is
  what TRL does when it wraps the model itself from a ``peft_config``.

GRPO: see ``trl_grpo_loss``.
"""
from __future__ import annotations

import contextlib
import tempfile

import numpy as np

# Replace TRL's float32 fused-LM-head kernel by a float64 (hidden-dtype) equivalent during the call.
FP64_LM_HEAD = True


def _fp64_head_apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
                     logit_scale=1.0, outputs=("log_probs",)):
    """``trl.kernels.ChunkedLogProbFunction.apply`` with the same arguments and outputs, by autograd in
    ``hidden``'s dtype instead of float32 statistics."""
    import torch
    z = hidden @ weight.to(hidden.dtype).t()
    if bias is not None:
        z = z + bias.to(hidden.dtype)
    z = z * logit_scale
    if final_logit_softcapping is not None:
        z = final_logit_softcapping * torch.tanh(z / final_logit_softcapping)
    z = z / temperature
    log_p = torch.log_softmax(z, dim=-1)
    logprobs = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1) if "entropy" in outputs else None
    with torch.no_grad():
        zd = z.detach()
        log_sum_sq = torch.logsumexp(2 * log_p.detach(), dim=-1) if "log_sum_sq_probs" in outputs else None
        mean_logits = zd.mean(-1) if "mean_logits" in outputs else None
        # torch.argmax returns the first maximum, TRL's kernel counts a tie with an earlier token as not top-1
        is_top1 = (zd.argmax(-1) == targets) if "is_top1" in outputs else None
    return logprobs, entropy, log_sum_sq, mean_logits, is_top1


class _Fp64LogProbHead:
    apply = staticmethod(_fp64_head_apply)


@contextlib.contextmanager
def _lm_head_precision(fp64: bool):
    import trl.trainer.utils as trl_utils
    saved = trl_utils._ChunkedLogProbFunction
    if fp64:
        trl_utils._ChunkedLogProbFunction = _Fp64LogProbHead
    try:
        yield
    finally:
        trl_utils._ChunkedLogProbFunction = saved


@contextlib.contextmanager
def lfm2_rmsnorm_in_input_dtype():
    """transformers' Lfm2RMSNorm normalises in float32 whatever the model's dtype (``hidden_states.to(
    torch.float32)``), so a ``.double()`` Lfm2ForCausalLM is NOT float64 end to end: its outputs carry
    float32 rounding (~1e-7 relative) and finite differences of its loss disagree with its autograd
    gradients. Within this context the norm computes in its input's dtype (same formula), which makes a
    float64 LFM2 float64 throughout (the RoPE cos/sin tables stay float32-rounded constants)."""
    import torch
    from transformers.models.lfm2 import modeling_lfm2

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    saved = modeling_lfm2.Lfm2RMSNorm.forward
    modeling_lfm2.Lfm2RMSNorm.forward = forward
    try:
        yield
    finally:
        modeling_lfm2.Lfm2RMSNorm.forward = saved


def _tokenizer(vocab_size: int, pad_id: int, eos_id: int):
    """A word-level fast tokenizer whose ids are 0..vocab_size-1 ("t0", "t1", ...): TRL's trainers want a
    processing class (pad/eos ids); the batches are built from token ids, so it never tokenizes them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=f"t{eos_id}"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=f"t{pad_id}", eos_token=f"t{eos_id}",
                                   unk_token=f"t{eos_id}")


def _pad_eos_ids(model) -> tuple[int, int]:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    vocab = cfg.vocab_size

    def valid(i, default):
        return i if isinstance(i, int) and 0 <= i < vocab else default
    return valid(getattr(cfg, "pad_token_id", None), 0), valid(getattr(cfg, "eos_token_id", None), min(1, vocab - 1))


@contextlib.contextmanager
def _restored(model, *more):
    """Undo what constructing a TRL trainer does to the caller's models and to the global RNGs: the
    instance ``forward`` that add_fused_lm_head sets, the pad ids mirrored onto the configs, the
    train/eval mode, the torch/numpy/python RNG states (TRL calls set_seed)."""
    import random

    import torch
    models = [m for m in (model, *more) if m is not None]
    inner = []
    for m in models:
        inner.append(m)
        if hasattr(m, "get_base_model"):
            inner.append(m.get_base_model())
    saved_fwd = [(m, m.__dict__.get("forward")) for m in inner]
    saved_cfg = []
    for m in inner:
        for cfg in {id(c): c for c in (m.config, m.config.get_text_config())}.values():
            saved_cfg.append((cfg, cfg.pad_token_id))
        gen = getattr(m, "generation_config", None)
        if gen is not None:
            saved_cfg.append((gen, gen.pad_token_id))
    saved_mode = [(m, m.training) for m in models]
    rng = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    try:
        yield
    finally:
        for m, fwd in saved_fwd:
            if fwd is None:
                m.__dict__.pop("forward", None)
            else:
                m.__dict__["forward"] = fwd
        for cfg, pad in saved_cfg:
            cfg.pad_token_id = pad
        for m, mode in saved_mode:
            m.train(mode)
        torch.set_rng_state(rng[0])
        np.random.set_state(rng[1])
        random.setstate(rng[2])


@contextlib.contextmanager
def _quiet():
    """No datasets/transformers progress bars and no deprecation warnings from building a trainer."""
    import warnings

    import datasets
    import transformers
    bars = datasets.utils.logging.is_progress_bar_enabled()
    tbars = transformers.utils.logging.is_progress_bar_enabled()
    datasets.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        if bars:
            datasets.utils.logging.enable_progress_bar()
        if tbars:
            transformers.utils.logging.enable_progress_bar()


def _check_pairs(pairs):
    if not pairs:
        raise ValueError("pairs is empty")
    for p, c, r in pairs:
        if not p or not c or not r:
            raise ValueError("every prompt, chosen and rejected needs at least one token")


def trl_dpo(model, ref_model, pairs, *, beta=0.1, loss_type="sigmoid", label_smoothing=0.0):
    """TRL 1.16's DPO loss, metrics and gradients for ONE batch holding all ``pairs``.

    model: a transformers causal LM (e.g. transformers.Lfm2ForCausalLM, possibly a peft.PeftModel), in
    float64 and train mode (its mode is used as TRL uses it: 'train' metrics); ref_model: the frozen
    reference (a separate model), or None for a PeftModel, whose reference is then the model with its
    adapters disabled. pairs: list of (prompt_ids, chosen_ids, rejected_ids), lists of token ids, the
    completions without the prompt; the sequences are used exactly as given (no BOS/EOS added).

    Returns (loss, metrics, grads): the loss TRL returns (a float), the metrics TRL logs for this batch
    ('rewards/chosen', 'rewards/rejected', 'rewards/accuracies', 'rewards/margins', 'logps/chosen',
    'logps/rejected', 'entropy', 'logits/chosen', 'logits/rejected', 'mean_token_accuracy', 'num_tokens'),
    and each trainable parameter's gradient (``model.named_parameters()`` names) after
    ``loss.backward()``. Existing ``.grad``s are cleared first; the gradients are left on the model.
    """
    import torch
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    _check_pairs(pairs)
    if ref_model is model:
        raise ValueError("ref_model must be a separate model (or None for a PeftModel)")
    is_peft = hasattr(model, "peft_config")
    if ref_model is None and not is_peft:
        raise ValueError("ref_model=None is only for a peft.PeftModel (its reference: adapters disabled)")
    pad_id, eos_id = _pad_eos_ids(model)
    vocab = (model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config).vocab_size
    tokenizer = _tokenizer(vocab, pad_id, eos_id)
    training = model.training

    with _quiet(), _restored(model, ref_model), tempfile.TemporaryDirectory() as out, \
            _lm_head_precision(FP64_LM_HEAD):
        args = DPOConfig(
            output_dir=out, report_to="none", use_cpu=True, bf16=False, fp16=False, beta=beta,
            loss_type=[loss_type], label_smoothing=label_smoothing, gradient_checkpointing=False,
            max_length=None, per_device_train_batch_size=len(pairs), dataset_num_proc=None,
            disable_dropout=True, save_strategy="no", logging_strategy="no", seed=0,
            remove_unused_columns=False, dataloader_num_workers=0,
        )
        # The trainer wants a dataset to prepare; the batch below is built from the caller's token ids.
        dummy = Dataset.from_dict({"prompt": ["t2"], "chosen": ["t3"], "rejected": ["t4"]})
        adapters_before = set(model.peft_config) if is_peft else set()
        trainer = DPOTrainer(model=model, ref_model=ref_model, args=args, train_dataset=dummy,
                             processing_class=tokenizer)
        try:
            if is_peft and ref_model is None:
                # TRL added a "ref" copy of the adapter; drop it so the reference is the adapters-disabled model
                for name in set(model.peft_config) - adapters_before:
                    model.delete_adapter(name)
                model.set_adapter("default" if "default" in model.peft_config else sorted(adapters_before)[0])
            model.train(training)
            batch = trainer.data_collator([
                {"prompt_ids": list(map(int, p)), "chosen_ids": list(map(int, c)), "rejected_ids": list(map(int, r))}
                for p, c, r in pairs])
            model.zero_grad(set_to_none=True)
            for k in trainer._metrics:
                trainer._metrics[k].clear()
            loss = trainer.compute_loss(trainer.model, batch)
            loss.backward()
            mode = "train" if model.training else "eval"
            metrics = {k: float(sum(v) / len(v)) for k, v in trainer._metrics[mode].items()}
            grads = {n: p.grad.detach().cpu().numpy().copy() for n, p in model.named_parameters()
                     if p.requires_grad and p.grad is not None}
            missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
            for n in missing:  # a trainable parameter the loss does not reach (none in an LFM2)
                grads[n] = np.zeros(tuple(model.get_parameter(n).shape))
        finally:
            trainer.accelerator.free_memory()
    return float(loss.detach()), metrics, grads


def trl_grpo_loss(model, ref_model, prompt_ids, completion_ids, rewards, *, loss_type, beta, epsilon,
                  num_generations, old_per_token_logps=None, epsilon_high=None, max_completion_length=None,
                  scale_rewards="group", return_details=False, temperature=1.0):
    """TRL 1.16's GRPO loss and gradients for ONE batch of given (teacher-forced) completions.

    A real ``trl.GRPOTrainer`` is built around ``model``; generation is replaced through TRL's own
    ``rollout_func`` hook (it returns the given ids), the reward function returns ``rewards``, and TRL's
    ``_generate_and_score_completions`` (padding, reference log-probs, group-normalised advantages,
    ``num_items_in_batch``) and ``compute_loss`` -> ``_compute_loss`` run as written, then ``loss.backward()``.
    Run with torch's default dtype float64 so TRL's reward/advantage tensors are float64 (TRL still rounds
    each reward to float32 when it stores it, grpo_trainer.py l.1637: pass float32-representable rewards).

    prompt_ids: one list of token ids per group (len(completion_ids) // num_generations of them; group g
    holds completions [g*G, (g+1)*G)), or one per completion. completion_ids: list of B lists of token ids.
    rewards: B floats. loss_type: 'grpo', 'dr_grpo', 'dapo' (also 'bnpo', ...); beta: the KL coefficient
    (0: no reference; else ``ref_model``, or None for a PeftModel: adapters disabled); epsilon: the clip
    range (epsilon_high defaults to epsilon); old_per_token_logps: None (TRL's on-policy case: the detached
    current log-probs, ratio 1) or B lists of per-completion-token log-probs of the sampling policy.
    max_completion_length: the dr_grpo constant (default: the longest completion).
    Returns (loss, grads) -- or (loss, grads, details) with ``return_details`` (details: 'advantages',
    'ref_per_token_logps', 'num_items_in_batch', 'metrics').

    How TRL 1.16 builds and normalises it (grpo_trainer.py):
    - Layout (l.2440-2462): prompts LEFT-padded, completions RIGHT-padded, input = [pad.., prompt,
      completion, pad..]; only completion tokens are scored (l.1496: labels -100 outside the last C
      columns and on padding), the first completion token predicted from the last prompt token. Nothing is
      added to the given ids (no BOS/EOS). Left padding shifts the absolute positions of a shorter prompt
      (transformers counts positions from the padded start): give equal-length prompts to match exactly.
    - Advantages (l.2760-2810 and trl.trainer.utils.nanstd, scale_rewards='group'):
      A_i = (r_i - mean_group(r)) / (std_group(r) + 1e-4),
      std the UNBIASED (n-1) std of the group (trl.trainer.utils.nanstd); 'batch': std over the whole batch;
      'none': no division. A zero-std group gives advantages 0.
    - Per token (l.3083-3150): log_ratio = logp - old_logp (old = logp.detach() when not given, ratio 1);
      coef_1 = exp(log_ratio), coef_2 = clamp(coef_1, 1 - eps, 1 + eps_high);
      loss_t = -min(coef_1 * A, coef_2 * A) + beta * kl_t, kl_t = exp(ref - logp) - (ref - logp) - 1.
    - Aggregation over the batch (l.3153-3185), mask = completion mask:
      'grpo':    mean over sequences of (sum_t loss_t * mask / n_tokens_of_that_sequence)
      'bnpo':    sum(loss * mask) / sum(mask) over the batch
      'dr_grpo': sum(loss * mask) / (B * max_completion_length)  (a constant, the CONFIG value)
      'dapo':    sum(loss * mask) / num_items_in_batch, num_items_in_batch = total completion tokens of
                 the whole generation batch (all processes); here one batch, so = sum(mask) like 'bnpo'.
      (each divided by the gradient accumulation steps, 1 here).
    """
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    B = len(completion_ids)
    G = int(num_generations)
    if B == 0 or B % G:
        raise ValueError(f"{B} completions are not whole groups of {G}")
    if len(rewards) != B:
        raise ValueError("one reward per completion")
    if len(prompt_ids) == B // G and len(prompt_ids) != B:
        prompts = [list(map(int, prompt_ids[i // G])) for i in range(B)]
    elif len(prompt_ids) == B:
        prompts = [list(map(int, p)) for p in prompt_ids]
    else:
        raise ValueError("prompt_ids: one per group or one per completion")
    completions = [list(map(int, c)) for c in completion_ids]
    if any(not p for p in prompts) or any(not c for c in completions):
        raise ValueError("empty prompt or completion")
    is_peft = hasattr(model, "peft_config")
    if beta != 0.0 and ref_model is None and not is_peft:
        raise ValueError("beta != 0 needs a ref_model (or a PeftModel, whose reference has its adapters disabled)")
    pad_id, eos_id = _pad_eos_ids(model)
    vocab = (model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config).vocab_size
    tokenizer = _tokenizer(vocab, pad_id, eos_id)
    training = model.training
    reward_values = [float(r) for r in rewards]

    def rollout(prompt_texts, trainer):  # TRL's rollout hook: the given ids instead of generating
        return {"prompt_ids": prompts, "completion_ids": completions, "logprobs": None}

    def reward_fn(prompts=None, completions=None, completion_ids=None, **kwargs):
        return list(reward_values)

    import os
    saved_env = os.environ.get("TRL_EXPERIMENTAL_SILENCE")
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    saved_name = model.config._name_or_path
    saved_dtype = torch.get_default_dtype()
    with _quiet(), _restored(model, ref_model), tempfile.TemporaryDirectory() as out, \
            _lm_head_precision(FP64_LM_HEAD):
        try:
            if beta != 0.0 and ref_model is not None:
                # GRPOTrainer takes no ref_model: it loads one from model.config._name_or_path (l.995-1003)
                ref_dir = os.path.join(out, "ref")
                ref_model.save_pretrained(ref_dir)
                model.config._name_or_path = ref_dir
            args = GRPOConfig(
                output_dir=os.path.join(out, "run"), report_to="none", use_cpu=True, bf16=False, fp16=False,
                beta=beta, epsilon=epsilon, epsilon_high=epsilon_high, loss_type=loss_type,
                num_generations=G, per_device_train_batch_size=B, gradient_accumulation_steps=1,
                steps_per_generation=1, max_completion_length=max_completion_length or max(map(len, completions)),
                scale_rewards=scale_rewards, gradient_checkpointing=False, disable_dropout=True,
                save_strategy="no", logging_strategy="no", seed=0, temperature=temperature, log_completions=False,
                dataloader_num_workers=0, pad_to_multiple_of=None,
            )
            dummy = Dataset.from_dict({"prompt": ["t2"] * G})
            adapters_before = set(model.peft_config) if is_peft else set()
            trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=args, train_dataset=dummy,
                                  processing_class=tokenizer, rollout_func=rollout)
            model.config._name_or_path = saved_name
            if is_peft:
                for name in set(model.peft_config) - adapters_before:
                    model.delete_adapter(name)
            model.train(training)
            trainer.current_gradient_accumulation_steps = 1  # what the training loop sets for one micro-batch
            torch.set_default_dtype(torch.float64)
            for k in trainer._metrics:
                trainer._metrics[k].clear()
            batch = trainer._generate_and_score_completions([{"prompt": "t2"} for _ in range(B)])
            if old_per_token_logps is not None:
                C = batch["completion_ids"].size(1)
                old = torch.zeros((B, C), dtype=torch.float64)
                for i, row in enumerate(old_per_token_logps):
                    row = [float(x) for x in row]
                    if len(row) != len(completions[i]):
                        raise ValueError(f"old_per_token_logps[{i}]: {len(row)} values, "
                                         f"{len(completions[i])} tokens")
                    old[i, : len(row)] = torch.tensor(row, dtype=torch.float64)
                batch["old_per_token_logps"] = old
            model.zero_grad(set_to_none=True)
            loss = trainer.compute_loss(trainer.model, batch)
            loss.backward()
            mode = "train" if model.training else "eval"
            metrics = {k: float(sum(v) / len(v)) for k, v in trainer._metrics[mode].items() if len(v)}
            grads = {n: p.grad.detach().cpu().numpy().copy() for n, p in model.named_parameters()
                     if p.requires_grad and p.grad is not None}
            for n, p in model.named_parameters():
                if p.requires_grad and p.grad is None:
                    grads[n] = np.zeros(tuple(p.shape))
            trainer.accelerator.free_memory()
        finally:
            torch.set_default_dtype(saved_dtype)
            model.config._name_or_path = saved_name
            if saved_env is None:
                os.environ.pop("TRL_EXPERIMENTAL_SILENCE", None)
            else:
                os.environ["TRL_EXPERIMENTAL_SILENCE"] = saved_env
    if not return_details:
        return float(loss.detach()), grads
    details = {
        "advantages": batch["advantages"].detach().cpu().numpy().copy(),
        "ref_per_token_logps": (batch["ref_per_token_logps"].detach().cpu().numpy().copy()
                                if "ref_per_token_logps" in batch else None),
        "num_items_in_batch": float(batch["num_items_in_batch"]),
        "metrics": metrics,
    }
    return float(loss.detach()), grads, details
