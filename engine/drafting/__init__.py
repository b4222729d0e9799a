"""What proposes and verifies drafts: the drafters (prompt lookup, a draft model, EAGLE / EAGLE-2
/ EAGLE-3 over their head models), the draft trees, and lossless rejection sampling."""
