"""Moving blocks: one copy, tiers (demotion, promotion, drains), spreading, orphans."""
