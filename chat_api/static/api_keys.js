// "Use from other apps": the OpenAI-compatible base URL, and a button that makes an API key
// (POST /v1/keys) and shows it once: only its hash is stored, so it cannot be shown again.
import { api, describe, withAuth } from "./connection.js";

export function enableApiKeys() {
  const baseUrl = document.getElementById("openai-base-url");
  const button = document.getElementById("create-key");
  const field = document.getElementById("new-key");
  const note = document.getElementById("key-note");
  baseUrl.textContent = `${location.origin}/openai/v1`;
  button.addEventListener("click", async () => {
    button.disabled = true;
    note.textContent = "";
    try {
      const made = await withAuth(() => api.request("POST", "/v1/keys", { name: "made on the chat page" }));
      field.value = made.key;
      field.hidden = false;
      field.focus();
      field.select();
      note.textContent = "Copy it now: it is shown only once. Revoke it with DELETE /v1/keys/" + made.id + ".";
    } catch (error) {
      note.textContent = `No key was made: ${describe(error)}`;
    } finally {
      button.disabled = false;
    }
  });
}
