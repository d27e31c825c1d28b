"""The torch model layer: weights, KV tensor pool, attention, sampler and the TorchRunner.

Only this package imports torch; its tokenizer, loader and Runner protocol modules do not."""
