"""creditlab.rewards"""
