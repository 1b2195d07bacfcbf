// The `openai` npm package from Node: a chat, a streamed chat and a tool call, at the proxy's base
// URL with the tags as default headers. Run by tests/client_runs.py from the directory the
// package is installed in (package-lock.json's pin).
//
//   node openai_node.mjs '{"base_url": ..., "headers": {...}, "mode": "chat|stream|tool"}'
import OpenAI from "openai";

const config = JSON.parse(process.argv[2]);
const client = new OpenAI({
  baseURL: config.base_url,
  apiKey: "x",
  defaultHeaders: config.headers,
  timeout: 120000,
});
const request = {
  model: config.model ?? "demo",
  messages: [{ role: "user", content: config.question ?? "What is 3 + 4?" }],
  max_tokens: config.max_tokens ?? 8,
  ...(config.extra_body ?? {}),
};
const weather = {
  type: "function",
  function: {
    name: "get_weather",
    description: "The weather in a city.",
    parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
  },
};
let out;
if (config.mode === "stream") {
  const stream = await client.chat.completions.create({
    ...request,
    stream: true,
    stream_options: { include_usage: true },
  });
  let text = "";
  let usage = null;
  for await (const chunk of stream) {
    text += chunk.choices[0]?.delta?.content ?? "";
    usage = chunk.usage ?? usage;
  }
  out = { text, usage };
} else {
  const tools = config.mode === "tool" ? { tools: [weather] } : {};
  const { data, response } = await client.chat.completions
    .create({ ...request, ...tools })
    .withResponse();
  const message = data.choices[0].message;
  out = {
    text: message.content,
    tool_calls: message.tool_calls ?? null,
    usage: data.usage,
    transition_id: response.headers.get("x-transition-id"),
  };
}
console.log(JSON.stringify(out));
