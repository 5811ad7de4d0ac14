"""kpipe.llm"""
