"""Neural-network layers of the hybrid model: norms, rotary embedding, gated delta rule, paged attention."""
