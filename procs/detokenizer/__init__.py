"""The detokenizer process: token ids -> text for the api.

`incremental.IncrementalDetokenizer` (one per request) turns streamed token ids into text without
splitting UTF-8 characters, `stop_strings.StopStringMatcher` holds back text that could still
become a stop string, and `process` runs them behind the scheduler's and the api's sockets.
"""
