"""What the tests share, defined once: a settable clock, tenants as the core names them, request
views, free loopback ports, the chi-square test, and the real servers the tests start (uvicorn,
grpc, redis-server, fleet replicas) with their test doubles of engines."""
