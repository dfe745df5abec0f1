// The playground: a chat that streams from /v1/chat/completions. Stop aborts the fetch, which closes the
// connection; the server then aborts the request in the engine, and its waterfall shows the abort.

import { apiFetch, readEvents } from "./net.js";

const $ = (id) => document.getElementById(id);

export class Playground {
  constructor({ onRequest, onDone }) {
    this.history = []; // [{role, content}] of finished turns
    this.controller = null;
    this.onRequest = onRequest; // (id) when the stream's first chunk names the request
    this.onDone = onDone; // (id, how) when it ends: "done", "stopped" or "error"
    $("pg-form").addEventListener("submit", (e) => {
      e.preventDefault();
      this.send();
    });
    $("pg-prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) this.send();
    });
    $("pg-stop").addEventListener("click", () => this.controller?.abort());
    $("pg-clear").addEventListener("click", () => this.clear());
  }

  params() {
    const number = (id) => Number($(id).value);
    return { temperature: number("pg-temperature"), top_p: number("pg-top-p"), max_tokens: number("pg-max-tokens") };
  }

  bubble(role, text) {
    const node = document.createElement("div");
    node.className = `msg ${role}`;
    node.textContent = text;
    $("pg-transcript").append(node);
    return node;
  }

  clear() {
    this.controller?.abort();
    this.history = [];
    $("pg-transcript").replaceChildren();
    this.status("idle");
  }

  status(text) {
    $("pg-status").textContent = text;
  }

  busy(on) {
    $("pg-send").disabled = on;
    $("pg-stop").disabled = !on;
  }

  async send() {
    const prompt = $("pg-prompt").value.trim();
    if (!prompt || this.controller) return;
    $("pg-prompt").value = "";
    const messages = [...this.history, { role: "user", content: prompt }];
    this.bubble("user", prompt);
    const answer = this.bubble("assistant", "");
    answer.id = "pg-output";
    document.querySelectorAll(".msg.assistant").forEach((n) => n !== answer && n.removeAttribute("id"));
    this.controller = new AbortController();
    this.busy(true);
    this.status("waiting for the first token…");
    let requestId = null, text = "", how = "done";
    try {
      const response = await apiFetch("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ messages, stream: true, ...this.params() }),
        signal: this.controller.signal,
      });
      await readEvents(response, (data) => {
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (!requestId && chunk.id) {
          requestId = chunk.id;
          this.showId(requestId);
          this.onRequest(requestId);
        }
        const choice = chunk.choices?.[0];
        if (choice?.delta?.content) {
          text += choice.delta.content;
          answer.textContent = text;
          this.status(`streaming… ${text.length} characters`);
        }
        if (choice?.finish_reason) this.status(`finished: ${choice.finish_reason}`);
      });
      this.history = [...messages, { role: "assistant", content: text }];
    } catch (error) {
      if (error.name === "AbortError") {
        how = "stopped";
        this.status("stopped: the connection was closed, the server aborts the request");
        answer.classList.add("stopped");
      } else {
        how = "error";
        this.status(`error: ${error.message}`);
        answer.classList.add("error");
        if (!text) answer.textContent = error.message;
      }
    } finally {
      this.controller = null;
      this.busy(false);
      if (requestId) this.onDone(requestId, how);
    }
  }

  showId(id) {
    const link = $("pg-request-id");
    link.textContent = `waterfall of ${id}`;
    link.dataset.requestId = id;
    link.hidden = false;
  }
}
