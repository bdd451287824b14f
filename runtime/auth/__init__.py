"""The cluster key and what it signs: room tickets (router -> workers), bootstrap calls
(decode -> prefill) and KV links (prefill <-> decode). Torch-free: the router imports it."""
