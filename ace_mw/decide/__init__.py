"""Deciding one request: which mode and settings apply (policy), the temperature and breaker
gates (gate), and the speed policy that picks the fastest arm (speed).
"""
