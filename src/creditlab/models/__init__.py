"""creditlab.models"""
