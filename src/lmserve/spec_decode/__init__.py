"""Speculative decoding (`--speculative-config`): drafts for a request's next tokens, verified in one forward pass.

One package, as vLLM V1's `v1/spec_decode/`, in the order a step meets it:
- `proposer.py`: the one interface every proposer implements (`Proposer.propose`: draft tokens per request);
- `speculator.py`: the engine's side, which the scheduler asks for each decoding request's drafts: whom to draft
  for, how many (an acceptance gate per request, so that speculation never costs), a grammar's vetting of them, and
  the counters (`spec_decode_*` in /metrics);
- `ngram.py`: prompt lookup, the engine's proposer (method `ngram`);
- `draft_model.py`: a small model's greedy guesses (method `draft_model`), the worker's proposer: the scheduler
  reserves the positions (ReservedPositions), and the runner asks it for their tokens before it builds the batch.

Verification (which drafts a step keeps) is the sampler's: worker/rejection_sampler.py. The modules the engine
imports here touch no tensors; `draft_model.py` runs a model and is imported by the worker only.
"""
