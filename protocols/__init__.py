"""Training loops and the gossip layer they publish through (DiLoCo, SAPO, SPSA)."""
