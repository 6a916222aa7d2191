"""Discovery and signed records on hivemind's DHTNode."""
