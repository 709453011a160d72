"""jobs/bench"""
