"""The public calls: process groups and their life cycle (group), collectives'
argument checks (collectives), and the fast paths around them (fast)."""
