"""jobs/models"""
