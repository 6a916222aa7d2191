"""Built-in tasks, each an implementation of the task seam (``protocols.task``): ``tinygpt`` (DiLoCo, SPSA),
``arith`` (SAPO), ``digits`` (DiLoCo, SPSA: images), ``hf-text`` (DiLoCo, SPSA: a transformers causal LM on real
text) and ``reasoning-gym`` (SAPO). A user's own task file follows the same contract."""
