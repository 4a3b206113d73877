"""creditlab.integrations"""
