"""jobs/data"""
