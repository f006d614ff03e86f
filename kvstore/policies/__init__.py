"""Eviction and admission policies (DESIGN §4): pure objects, no I/O, no clock, no DB.

The spine places blocks until a tier is full and then rejects with `no_space`;
policies, watermarks and demotion arrive with the policy and tiers issues.
"""
