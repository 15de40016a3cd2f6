"""The contract between the worker and its ranks, in one home below both.

`plan`: what a builder returns (Plan, BuildContext); `data`: the datasets the engine reads (TokenFile,
Shards, Stream, data_path); `env`: the environment variables the worker sets for the ranks;
`checkpoints`: the names of checkpoint files, which the API reads too (it derives a checkpoint's
file from its job and step, never from what a job reported). The
engine, the worker and the SDK (`dptrain`, whose `dptrain.plan` and `dptrain.data` re-export these
under the names users write) all import this package; it imports none of them.

Importing the package, `rank_contract.env` or `rank_contract.checkpoints` is cheap and torch-free
(the light client imports `dptrain`, which reads `env`); `plan` and `data` import torch.
"""
