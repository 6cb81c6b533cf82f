// The AI SDK's chat as useChat runs it, without React: its AbstractChat with the state React's
// useChat keeps in a useState, kept in a field.
import { AbstractChat } from 'ai';

class ChatState {
  constructor(messages = []) {
    this.status = 'ready';
    this.error = undefined;
    this.messages = messages;
  }
  pushMessage(message) {
    this.messages = this.messages.concat(message);
  }
  popMessage() {
    this.messages = this.messages.slice(0, -1);
  }
  replaceMessage(index, message) {
    this.messages = [...this.messages.slice(0, index), message, ...this.messages.slice(index + 1)];
  }
  snapshot(value) {
    return structuredClone(value);
  }
}

export class Chat extends AbstractChat {
  constructor({ messages, ...options }) {
    super({ ...options, state: new ChatState(messages) });
  }
}
