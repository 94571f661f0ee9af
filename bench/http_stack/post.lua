-- wrk script: POST a ~200 B OpenAI-style chat request (non-streaming).
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"llama-3-8b-instruct","messages":[{"role":"system","content":"You are a terse assistant."},{"role":"user","content":"Say hello in five words, please. Keep it short."}],"max_tokens":16,"temperature":0.2,"stream":false}'
