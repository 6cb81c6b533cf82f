// The page's connection to the backend as the person meets it: the one Api client, the
// banner that says plainly what went wrong, waits before retrying, and the token dialog that
// a refused token (401) opens before the call is tried once more.

import { Api, ApiError, NetworkError } from "./api.js";

export const api = new Api();

const $ = (id) => document.getElementById(id);
const ui = {
  banner: $("banner"),
  tokenDialog: $("token-dialog"),
  tokenForm: $("token-form"),
  tokenInput: $("token-input"),
  tokenError: $("token-error"),
};

// --- banner: connection and request errors, said plainly ---------------------------------

export function showBanner(message) {
  ui.banner.textContent = message;
  ui.banner.hidden = false;
}

export function clearBanner() {
  ui.banner.hidden = true;
  ui.banner.textContent = "";
}

export function describe(error) {
  if (error instanceof NetworkError) return "The server cannot be reached. Retrying when the network returns…";
  if (error instanceof ApiError) return `${error.message} (${error.status} ${error.code})`;
  return String(error.message || error);
}

/** Wait `ms`, or less if the browser says the network is back. */
export function waitToRetry(ms, signal) {
  return new Promise((resolve) => {
    const done = () => {
      clearTimeout(timer);
      window.removeEventListener("online", done);
      signal?.removeEventListener("abort", done);
      resolve();
    };
    const timer = setTimeout(done, ms);
    window.addEventListener("online", done);
    signal?.addEventListener("abort", done);
  });
}

// --- token ------------------------------------------------------------------------------

export async function askForToken(reason) {
  ui.tokenError.textContent = reason || "";
  ui.tokenInput.value = "";
  if (!ui.tokenDialog.open) ui.tokenDialog.showModal();
  return new Promise((resolve) => {
    ui.tokenForm.onsubmit = async (event) => {
      event.preventDefault();
      api.rememberToken(ui.tokenInput.value.trim());
      try {
        await api.listConversations();
      } catch (error) {
        ui.tokenError.textContent = describe(error);
        if (error instanceof ApiError && error.status === 401) api.forgetToken();
        return;
      }
      ui.tokenDialog.close();
      resolve();
    };
  });
}

/** Run an API call; a 401 asks for a (new) token and tries once more. */
export async function withAuth(call) {
  try {
    return await call();
  } catch (error) {
    if (!(error instanceof ApiError) || error.status !== 401) throw error;
    api.forgetToken();
    await askForToken("The token was refused. Paste a valid access token (`chatmem token`).");
    return call();
  }
}
