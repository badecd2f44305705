// rollbus trajectory viewer: the session list and the session page. Plain DOM, no build step.
// Everything from the log is put in the page as text (textContent), never as markup.
"use strict";

const POLL_MS = 2000;

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child);
  return node;
}

async function getJSON(url) {
  const response = await fetch(url, { cache: "no-store" });
  const body = await response.json();
  if (!response.ok) throw new Error(body.error ? body.error.message : response.statusText);
  return body;
}

function showError(error) {
  const box = document.getElementById("error");
  box.textContent = String(error.message || error);
  box.hidden = false;
}

function plural(count, noun) {
  return `${count} ${noun}${count === 1 ? "" : "s"}`;
}

function ago(seconds) {
  seconds = Math.max(0, seconds);
  for (const [unit, size] of [["d", 86400], ["h", 3600], ["m", 60]]) {
    if (seconds >= size) return `${Math.round(seconds / size)}${unit} ago`;
  }
  return `${Math.round(seconds)}s ago`;
}

const when = (t) => new Date(t * 1000).toISOString().replace("T", " ").slice(0, 19);
const fmtReward = (r) => (r === null || r === undefined ? "-" : Number(r).toPrecision(3).replace(/\.?0+$/, ""));

// --- the session list --------------------------------------------------------------------

function listPage() {
  const params = new URLSearchParams(location.search);
  const form = document.getElementById("filters");
  document.getElementById("f-uid").value = params.get("uid") || "";
  document.getElementById("f-status").value = params.get("status") || "";
  if (params.get("limit")) document.getElementById("f-limit").value = params.get("limit");
  const cursors = [null]; // cursors[i]: where page i starts
  let page = 0;

  async function load() {
    const query = new URLSearchParams();
    for (const name of ["uid", "status", "limit"]) {
      const value = document.getElementById(`f-${name}`).value.trim();
      if (value) query.set(name, value);
    }
    if (cursors[page]) query.set("after", cursors[page]);
    try {
      const data = await getJSON(`/api/sessions?${query}`);
      renderRows(data);
      cursors[page + 1] = data.next;
      document.getElementById("prev").disabled = page === 0;
      document.getElementById("next").disabled = !data.next;
      document.getElementById("page-no").textContent = `page ${page + 1}`;
      document.getElementById("error").hidden = true;
      document.body.dataset.loaded = String(Date.now());
    } catch (error) {
      showError(error);
    }
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    cursors.length = 1;
    page = 0;
    const shown = new URLSearchParams();
    for (const name of ["uid", "status"]) {
      const value = document.getElementById(`f-${name}`).value.trim();
      if (value) shown.set(name, value);
    }
    history.replaceState(null, "", shown.toString() ? `/?${shown}` : "/");
    load();
  });
  document.getElementById("next").addEventListener("click", () => { page += 1; load(); });
  document.getElementById("prev").addEventListener("click", () => { page = Math.max(0, page - 1); load(); });
  load();
}

function chainsCell(s) {
  // the chains, and how many forked (by cause, on hover)
  const forks = Object.entries(s.forks || {});
  const forked = forks.reduce((n, [, count]) => n + count, 0);
  return el("td", { class: "num chains", text: forked ? `${s.chains} (${forked} forked)` : String(s.chains),
    title: forks.map(([cause, count]) => `${cause} ${count}`).join(", ") });
}

function renderRows(data) {
  const now = Date.now() / 1000;
  const body = document.querySelector("#sessions tbody");
  body.replaceChildren(...data.sessions.map((s) => el("tr", { "data-session": s.session_id },
    el("td", { class: "sid" }, el("a", { href: `/session/${s.session_id}`, text: s.session_id })),
    el("td", {}, el("span", { class: `status ${s.status}`, text: s.status })),
    el("td", { text: s.uid }), el("td", { class: "num", text: s.session_index }),
    el("td", { class: "num", text: s.turns }), chainsCell(s),
    el("td", { class: "num", text: s.trajectories }), el("td", { class: "num", text: fmtReward(s.reward) }),
    el("td", { text: s.reason }), el("td", { text: ago(now - s.opened_at), title: when(s.opened_at) }))));
  document.getElementById("counts").textContent =
    `${data.sessions.length} shown of ${data.matching} matching; ${data.total} sessions in all`;
}

// --- one session -------------------------------------------------------------------------

function heat(logprob) {
  // white for a sure token, towards red for an unlikely one
  const p = Math.exp(Math.max(-20, logprob));
  const alpha = Math.min(0.85, 1 - p);
  return `rgba(239, 68, 68, ${alpha.toFixed(3)})`;
}

function imageSpan(sessionId, image) {
  // an image where it stands in the token stream: its thumbnail (from the log's object store) and its token count
  return el("span", { class: "image", "data-digest": image.digest, "data-i": image.offset, "data-tokens": image.tokens,
    title: `#${image.offset} ${image.media_type} ${image.width}x${image.height}, ${image.tokens} image tokens, sha256 ${image.digest}` },
  el("img", { class: "thumb", src: `/api/sessions/${sessionId}/images/${image.digest}`, loading: "lazy",
    alt: `image ${image.width}x${image.height}` }),
  el("span", { class: "image-label", text: `image ${image.width}x${image.height} · ${plural(image.tokens, "token")}` }));
}

function tokenSpans(win, sessionId) {
  const spans = [];
  const starts = new Set(win.turn_starts);
  const images = win.images || [];
  let next = 0; // the next image of the window
  for (let i = 0; i < win.ids.length; i++) {
    if (starts.has(i)) spans.push(el("span", { class: "turn-mark", text: "turn", "aria-hidden": "true" }));
    const at = win.offset + i;
    while (next < images.length && images[next].offset + images[next].tokens <= at) next++;
    if (next < images.length && images[next].offset <= at) { // its placeholder run: drawn as the image, once
      spans.push(imageSpan(sessionId, images[next]));
      i = Math.min(win.ids.length, images[next].offset + images[next].tokens - win.offset) - 1;
      next++;
      continue;
    }
    const mask = win.mask[i];
    const kind = win.part === "prompt" ? "prompt" : mask ? "model" : "ctx";
    const text = win.text ? win.text[i] : `[${win.ids[i]}]`;
    const logprob = win.logprobs ? win.logprobs[i] : null;
    const span = el("span", { class: `tok ${kind}`, "data-i": at, "data-id": win.ids[i],
      "data-mask": mask, title: `#${at} id ${win.ids[i]}${logprob === null ? "" : ` logprob ${logprob.toFixed(4)}`}` });
    span.textContent = text;
    if (kind === "model" && logprob !== null) {
      span.style.backgroundColor = heat(logprob);
      span.dataset.logprob = logprob;
    }
    spans.push(span);
  }
  return spans;
}

function tokenBox(sessionId, chainIndex, part, first) {
  const box = el("div", { class: `tokens ${part}`, "data-chain": chainIndex });
  const more = el("button", { class: "more", text: "more tokens" });
  const note = el("p", { class: "muted window-note" });
  const holder = el("div", {}, box, note, more);
  function add(win) {
    box.append(...tokenSpans(win, sessionId));
    const shown = win.offset + win.ids.length;
    note.textContent = `${part}: tokens 0–${shown} of ${win.length}${win.next_offset === null ? "" : " (the rest on demand)"}`;
    more.hidden = win.next_offset === null;
    more.onclick = async () => {
      try {
        add(await getJSON(`/api/sessions/${sessionId}/chains/${chainIndex}/tokens?part=${part}&offset=${win.next_offset}`));
      } catch (error) { showError(error); }
    };
  }
  if (first) add(first);
  else {
    more.hidden = false;
    more.textContent = `load ${part} tokens`;
    more.onclick = async () => {
      more.textContent = "more tokens";
      try { add(await getJSON(`/api/sessions/${sessionId}/chains/${chainIndex}/tokens?part=${part}`)); }
      catch (error) { showError(error); }
    };
  }
  return holder;
}

function pre(label, text, cls = "") {
  return el("div", { class: cls }, el("div", { class: "label", text: label }), el("pre", { text }));
}

function turnCard(sessionId, turn) {
  const card = el("div", { class: "turn", "data-request": turn.request_no },
    el("div", {}, el("strong", { text: `turn ${turn.number}` }),
      el("span", { class: "muted", text: ` · request ${turn.request_no} · finish ${turn.finish_reason} · ` +
        `${turn.context_tokens} context + ${turn.sampled_tokens} sampled tokens · ${when(turn.time)}` +
        (turn.weight_version ? ` · weights ${turn.weight_version}` : "") })));
  if (turn.context_text) {
    const details = el("details", {}, el("summary", { text: "context appended (new messages, tool results)" }),
      el("pre", { class: "context", text: turn.context_text }));
    card.append(details);
  }
  if (turn.reasoning) card.append(pre("reasoning", turn.reasoning, "reasoning"));
  if (turn.text) card.append(pre("reply", turn.text, "reply"));
  for (const call of turn.tool_calls) {
    card.append(el("div", { class: "tool" }, el("span", { class: "label", text: "tool call " }),
      el("strong", { text: call.name }), el("span", { class: "muted mono", text: ` ${call.id}` }),
      el("pre", { text: call.arguments })));
  }
  const raw = el("pre", { class: "raw", hidden: "" });
  card.append(el("button", { text: "raw request", onclick: () => showRaw(sessionId, turn.request_no, raw) }), raw);
  return card;
}

async function showRaw(sessionId, requestNo, target) {
  if (!target.hidden) { target.hidden = true; return; }
  try {
    const response = await fetch(`/api/sessions/${sessionId}/requests/${requestNo}`, { cache: "no-store" });
    const text = await response.text();
    let shown = text;
    try { shown = JSON.stringify(JSON.parse(text), null, 2); } catch (_) { /* shown as sent */ }
    target.textContent = response.ok ? shown : `error ${response.status}: ${text}`;
    target.hidden = false;
  } catch (error) { showError(error); }
}

function forkText(fork) {
  if (!fork) return "no fork recorded";
  if (fork.parent === null || fork.parent === undefined) return fork.cause;
  return `${fork.cause} from chain ${fork.parent} at message ${fork.message_index}, token ${fork.token_offset}`;
}

function forkTree(chains) {
  // chains under their parents; a chain without one (or whose parent is not listed) at the top
  const listed = new Set(chains.map((c) => c.index));
  const children = new Map();
  for (const chain of chains) {
    const parent = chain.fork && listed.has(chain.fork.parent) ? chain.fork.parent : null;
    if (!children.has(parent)) children.set(parent, []);
    children.get(parent).push(chain);
  }
  const node = (chain) => {
    const cause = chain.fork ? chain.fork.cause : "unrecorded";
    const item = el("li", { "data-chain": chain.index, "data-cause": cause },
      el("a", { href: `#chain-${chain.index}`, text: `chain ${chain.index}` }), " ",
      el("span", { class: `cause ${cause}`, text: cause }),
      el("span", { class: "muted", text: (chain.fork && chain.fork.parent !== null && chain.fork.parent !== undefined
        ? ` · at message ${chain.fork.message_index}, token ${chain.fork.token_offset}` : "") +
        ` · ${plural(chain.turns.length + chain.turns_omitted, "turn")} · ${chain.prompt_len}+${chain.response_len} tokens` }));
    const below = children.get(chain.index) || [];
    if (below.length) item.append(el("ul", {}, ...below.map(node)));
    return item;
  };
  return (children.get(null) || []).map(node);
}

function chainCard(sessionId, chain, sessionStatus) {
  // a chain still open when its session ended becomes a trajectory with the session's reason
  const status = chain.materialization_reason ? `closed (${chain.materialization_reason})`
    : sessionStatus === "open" ? "open" : `ended with the session (${sessionStatus})`;
  const runs = chain.mask_runs.map(([v, n]) => `${v}x${n}`).join(" ") || "-";
  const card = el("section", { class: "card chain", id: `chain-${chain.index}` },
    el("h2", { text: `chain ${chain.index} · ${status}` }),
    el("p", { class: "fork", text: `fork: ${forkText(chain.fork)}` }),
    el("p", { class: "muted", text: `prompt ${chain.prompt_len} · response ${chain.response_len} (sampled ` +
      `${chain.sampled_len}, context ${chain.response_len - chain.sampled_len}) · log probs ` +
      `${chain.has_logprobs ? "yes" : "no"} · ${plural(chain.turns.length + chain.turns_omitted, "turn")} · mask ${runs}` }));
  const prompt = el("details", { class: "prompt" }, el("summary", { text: `prompt (${chain.prompt_len} tokens)` }),
    tokenBox(sessionId, chain.index, "prompt", chain.prompt));
  card.append(prompt, el("h3", { text: "response" }), tokenBox(sessionId, chain.index, "response", chain.response));
  const turns = el("div", { class: "turns" }, ...chain.turns.map((t) => turnCard(sessionId, t)));
  if (chain.turns_omitted) turns.append(el("p", { class: "notice", text: `${chain.turns_omitted} more turns not listed` }));
  card.append(el("h3", { text: "turns" }), turns);
  return card;
}

function overview(data) {
  const s = data.summary;
  const reward = data.reward;
  const rows = [["status", s.status + (s.close_reason && s.close_reason !== s.status ? ` (${s.close_reason})` : "") +
      (s.quarantined ? ` · quarantined: ${s.quarantined}` : "")],
    ["uid", s.uid], ["session index", s.session_index], ["agent", s.agent_name || "-"],
    ["reward", reward ? `${fmtReward(reward.reward)} (from ${reward.source})` : "-"],
    ["reward info", reward && Object.keys(reward.extra || {}).length ? JSON.stringify(reward.extra) : "-"],
    ["turns · requests · chains · trajectories", `${s.turns} · ${s.requests} · ${s.chains.length} · ${s.trajectories}`],
    ["opened · updated", `${when(s.opened_at)} · ${when(s.updated_at)}`],
    ["tokenizer", data.tokenizer + (data.decoded ? "" : " (not loadable here: token ids only)")],
    ["metadata", JSON.stringify(data.metadata)], ["log", `${s.seq} events, up to stream seq ${data.last_stream_seq}`]];
  const list = el("dl", { class: "kv" });
  for (const [key, value] of rows) list.append(el("dt", { text: key }), el("dd", { text: String(value) }));
  return [el("h2", { text: `session ${s.session_id}` }), list];
}

function renderSession(sessionId, data) {
  document.getElementById("overview").replaceChildren(...overview(data));
  document.getElementById("tree").replaceChildren(...forkTree(data.chains));
  document.getElementById("chains").replaceChildren(...data.chains.map((c) => chainCard(sessionId, c, data.status)));
  document.querySelector("#audit tbody").replaceChildren(...data.audit.map((a) => el("tr", { class: `audit ${a.kind}` },
    el("td", { class: "num", text: a.seq }), el("td", { text: when(a.time) }), el("td", { text: a.kind }),
    el("td", { text: a.chain ?? "" }), el("td", { text: a.request_no ?? "" }), el("td", { text: a.detail }))));
  document.getElementById("audit-note").textContent = data.audit.length ? (data.audit_omitted ?
    `${data.audit_omitted} earlier entries not shown` : "") : "no rollbacks, abandoned turns, failures or closes";
  const raw = document.getElementById("raw");
  document.querySelector("#requests tbody").replaceChildren(...data.requests.map((r) => el("tr", {},
    el("td", { class: "num", text: r.request_no }), el("td", { text: r.wire }), el("td", { class: "num", text: r.body_size }),
    el("td", { text: when(r.time) }),
    el("td", {}, el("button", { text: "show", onclick: () => showRaw(sessionId, r.request_no, raw) })))));
  document.getElementById("live").hidden = data.status !== "open";
  document.body.dataset.seq = String(data.last_stream_seq);
}

function sessionPage() {
  const sessionId = decodeURIComponent(location.pathname.split("/").pop());
  document.getElementById("sid").textContent = sessionId;
  document.title = `rollbus · ${sessionId}`;
  let known = null;
  async function poll() {
    try {
      const data = await getJSON(`/api/sessions/${sessionId}${known === null ? "" : `?known=${known}`}`);
      if (!data.unchanged) {
        renderSession(sessionId, data);
        known = data.last_stream_seq;
        document.body.dataset.loaded = String(Date.now());
      }
      document.getElementById("error").hidden = true;
      if (data.unchanged || data.status === "open") setTimeout(poll, POLL_MS); // live while it runs
    } catch (error) {
      showError(error);
      setTimeout(poll, POLL_MS * 2);
    }
  }
  poll();
}

document.addEventListener("DOMContentLoaded", () => {
  if (document.body.dataset.page === "list") listPage();
  else sessionPage();
});
