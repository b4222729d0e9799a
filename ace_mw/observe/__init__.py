"""Reading a response on its way to the client: the SSE parser and the observer that learns
acceptance and speed from it without delaying a byte.
"""
